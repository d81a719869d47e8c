"""Support for tests/test_grpo_run.py: a callback that saves what each optimizer step of a real
task=grpo run applies, and the run's tiny configuration.

`+callbacks.capture._target_=tests.grpo_run_support.CaptureSteps +callbacks.capture.out=DIR`:
before every update, rank 0 writes DIR/step<N>.pt with the parameters (whole: FSDP2's gathered),
the gradients the optimizer is about to apply, and every data-parallel rank's rollouts (its
groups: prompt, completions, lengths, truncated, rewards), gathered in rank order (the global
batch's order). Stateless, so adding it changes nothing a checkpoint holds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from engine.callbacks import Callback
from engine.distributed import all_gather_object, unwrap
from engine.step import StepContext

# gpt_tiny over the tests' tokenizer (320 ids); completions of at most L_MAX = 6 tokens and
# the clip range of tests/grpo_support.py, so that tests/test_grpo.py's reference applies.
MODEL = ["model=gpt_tiny", "model.vocab_size=320", "model.block_size=96"]
GPT_ARGS = {"vocab_size": 320, "block_size": 96, "n_layer": 2, "n_head": 2, "n_embd": 32}


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


class CaptureSteps(Callback):
    """Saves each step's parameters, gradients and rollouts (module docstring)."""

    state_optional = True

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        model = unwrap(ctx.model)
        params = {n: whole(t) for n, t in model.state_dict().items()}
        grads = {n: whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        records: Any = ctx.callbacks.named["rollouts"]
        current = records.step.current
        mine = [dataclasses.asdict(g) for g in current.groups]
        groups = [g for part in all_gather_object(mine, ctx.dist) for g in part]
        if ctx.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            step = ctx.step + 1
            torch.save(
                {"params": params, "grads": grads, "groups": groups}, self.out / f"step{step}.pt"
            )
