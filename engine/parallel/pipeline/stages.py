"""Cutting a model into pipeline stages: which blocks each stage runs, what a task sees as
"the model" on a stage, and pruning the model to one rank's stages."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, pairwise
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from engine.parallel.base import LayoutError


@runtime_checkable
class DeclaresStages(Protocol):
    def pipeline_stage(self, blocks: Sequence[int], first: bool, last: bool) -> nn.Module:
        """A module sharing this model's parameters that runs the blocks `blocks` (indices
        into `block_modules()`): from the model's inputs when `first`, else from the hidden
        state passed as its first argument; to the model's output when `last`, else to the
        hidden state (one tensor). It must not copy parameters."""
        ...


class NotSplittable(LayoutError):
    """The model cannot be cut into pipeline stages as asked."""

    def __init__(self, message: str) -> None:
        super().__init__("dist.pp", message)


def stage_ranges(sizes: Sequence[int], n_stages: int, split: Sequence[int] | None) -> list[range]:
    """Contiguous block ranges, one per stage: starting at the block indices `split` (one per
    stage after the first) when given, else balanced so the largest stage's parameter count
    (`sizes`, per block) is as small as it can be."""
    n = len(sizes)
    if n < n_stages:
        raise NotSplittable(
            f"{n} block{'' if n == 1 else 's'} cannot fill {n_stages} pipeline stages "
            "(dist.pp x dist.pp_virtual): "
            f"every stage needs at least one block and the model has {n}, so the largest valid "
            f"dist.pp is {n} (with dist.pp_virtual=V: {n} // V)"
        )
    if split:
        starts = [0, *split]
        if len(starts) != n_stages or any(b <= a for a, b in pairwise(starts)):
            raise NotSplittable(
                f"dist.pp_split must list {n_stages - 1} increasing block indices where stages "
                f"2..{n_stages} begin, got {list(split)}"
            )
        if starts[-1] >= n:
            raise NotSplittable(f"dist.pp_split: the model has {n} blocks, got {list(split)}")
        return [range(a, b) for a, b in zip(starts, [*starts[1:], n])]
    # Binary search on the largest stage; greedy packing decides whether a bound fits.
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_pack(sizes, mid, n_stages)) <= n_stages:
            hi = mid
        else:
            lo = mid + 1
    starts = _pack(sizes, lo, n_stages)
    return [range(a, b) for a, b in zip(starts, [*starts[1:], n])]


def _pack(sizes: Sequence[int], bound: int, n_stages: int) -> list[int]:
    """Stage start indices packing blocks greedily under `bound`, keeping at least one block
    for each stage still to come."""
    starts, total = [0], 0
    for i, s in enumerate(sizes):
        must_cut = len(sizes) - i <= n_stages - len(starts)  # one block left per later stage
        if i > starts[-1] and (total + s > bound or must_cut):
            starts.append(i)
            total = 0
        total += s
    return starts


class Forwarded(Exception):
    """Raised by `StageCall` on a stage that is not the last: the hidden state is out."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.output = output


class StageCall:
    """What a task sees as "the model" on a pipeline stage.

    The task calls it as it would call the model (`model(inputs)` or `model(**inputs)`); on a
    stage after the first, the first input is replaced by the hidden state received from the
    previous stage, and on a stage before the last the hidden state comes back out as
    `Forwarded`. So every stage runs the task's own code and the batch's other inputs (an
    attention mask) reach every stage. `output_head()` answers for the whole model (the
    chunked loss's decision is the same on every stage).
    """

    def __init__(
        self, stage: nn.Module, hidden: torch.Tensor | None, last: bool, head: nn.Module | None
    ) -> None:
        self.stage, self.hidden, self.last, self.head = stage, hidden, last, head

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.hidden is not None:
            if args:
                args = (self.hidden, *args[1:])
            else:  # a dict batch: the model's first input is `input_ids`
                kwargs = {**kwargs, "input_ids": self.hidden}
        out = self.stage(*args, **kwargs)
        if not self.last:
            raise Forwarded(out)
        return out

    def output_head(self) -> nn.Module | None:
        return self.head


class _NoHeadCall(StageCall):
    """A `StageCall` of a model without `output_head()`: not an `OutputHead`, plain logits."""

    output_head = None  # type: ignore[assignment]


def call_for(head: nn.Module | None) -> type[StageCall]:
    return StageCall if head is not None else _NoHeadCall


def prune(model: nn.Module, stages: Iterable[nn.Module]) -> None:
    """Drop from `model` every submodule whose parameters and buffers no stage uses."""
    used = {id(t) for st in stages for t in chain(st.parameters(), st.buffers())}

    def visit(module: nn.Module) -> None:
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            ids = {id(t) for t in chain(child.parameters(), child.buffers())}
            if ids and not ids & used:
                module._modules[name] = None
            elif ids - used:
                visit(child)
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in used:
                module._parameters[name] = None
        for name, b in list(module._buffers.items()):
            if b is not None and id(b) not in used:
                module._buffers[name] = None

    visit(model)
