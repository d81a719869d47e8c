"""Rollouts for `task=grpo`: the policy generates each prompt's G completions.

`sampling` makes a completion's tokens a function of (seed, step, prompt, completion index)
only (one group per call, one random stream per row, Gumbel-max); `engines` holds the
`GenerationEngine` interface and its implementations (transformers' generate, a recomputing
decoder for models that return logits, and the vLLM slot).
"""
