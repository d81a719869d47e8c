"""Reinforcement learning from rewards (`task=grpo`): the pieces that need no generation.

`advantages` (each completion's reward against its group's), `rollouts` (a step's groups of
completions and the micro-batches they become), `grpo` (the clipped policy-gradient loss and
its records). Generating the rollouts is trainer/rollout/'s; scoring them,
trainer/rollout/rewards.py's.
"""
