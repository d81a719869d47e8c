"""Support for tests/test_context_parallel.py: the trainer with torchtitan's context-parallel
accounting bug planted (open PR #3111: loss items counted before the sequences are split), to
show that the equality tests catch it.

`torchrun ... -m tests.cp_support [overrides]` is `-m trainer.train [overrides]` with
`AccumulateStep` counting the window's items on the whole sequences, on every `cp` rank, then
splitting them: the global count is `cp` times too large.
"""

from __future__ import annotations

import runpy
from collections.abc import Sequence
from typing import Any

from engine.step import StepContext, StepResult
from engine.steps.accumulate import AccumulateStep, apply_update, count_step, count_window


def count_before_split(self: AccumulateStep, ctx: StepContext, window: Sequence[Any]) -> StepResult:
    """`AccumulateStep.__call__` with the count taken before `local_batch` (the mutant)."""
    ctx.optimizer.zero_grad(set_to_none=True)
    global_count = count_window(ctx, window)  # the bug: items of the unsplit sequences
    window = [ctx.parallel.local_batch(b) for b in window]
    loss_sum = ctx.parallel.backward_window(ctx, window, global_count)
    grad_norm, found_inf, lr = apply_update(ctx)
    return count_step(ctx, StepResult(loss_sum, global_count, grad_norm, found_inf, lr))


if __name__ == "__main__":
    AccumulateStep.__call__ = count_before_split  # type: ignore[method-assign]
    runpy.run_module("trainer.train", run_name="__main__", alter_sys=True)


def labelled_dicts(**kwargs: Any) -> Any:
    """`data._target_`: the stdlib text as dict batches `{"input_ids", "labels"}` (labels =
    the inputs, shifted by the task), as transformers' data collators give them: a batch that
    context parallelism cannot split without `shift_labels`."""
    import dataclasses

    from trainer.data.text import text_data

    splits = text_data(**kwargs)

    def collate(samples: list[Any]) -> dict[str, Any]:
        inputs, _ = splits.collate_fn(samples)
        return {"input_ids": inputs, "labels": inputs.clone()}

    return dataclasses.replace(splits, collate_fn=collate)
