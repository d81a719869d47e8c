"""Support for tests/test_precision.py: a callback and a step strategy the trainer loads by
`_target_` (`+callbacks.inj._target_=tests.precision_support.InjectNonFinite`).

Heavy imports stay inside functions so that importing this module from Hydra is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.callbacks import Callback

if TYPE_CHECKING:
    import torch

    from engine.step import Batch, StepContext, StepResult

DEFAULT_PARAM = "blocks.0.mlp.fc.weight"  # not tied, so one hook call per backward


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def poison_next_backward(
    param: torch.Tensor, value: str = "inf"
) -> torch.utils.hooks.RemovableHandle:
    """Make the *next* gradient that reaches `param` non-finite, once.

    A tensor hook on a leaf runs before the gradient is accumulated into `.grad`, hence before
    DDP's reducer sees it: the non-finite value goes into the all-reduce like a real overflow
    in one micro-batch would. The hook removes itself after its first call.
    """
    factor = float(value)
    handle: Any = None

    def hook(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        return grad * factor

    handle = param.register_hook(hook)
    return handle


def param_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes: equal digests mean bitwise-equal weights."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class InjectNonFinite(Callback):
    """Poisons one micro-batch's gradient of optimizer step `step` (with `repeat`, also of every
    `every`-th step after it) on rank `rank` only (every rank when None).

    Armed from `on_after_optimizer_step` of the step before, so `step` must be >= 2. With
    `digest_dir`, each rank also appends `{step, digest}` of its parameters after every step to
    `digest_dir/rank<R>.jsonl`, so a test can check that ranks stayed bitwise in step.
    """

    def __init__(
        self,
        step: int,
        rank: int | None = None,
        value: str = "inf",
        repeat: bool = False,
        every: int = 1,
        param: str = DEFAULT_PARAM,
        digest_dir: str | None = None,
    ) -> None:
        if step < 2:
            raise ValueError("InjectNonFinite arms after the previous step: step must be >= 2")
        self.step = step
        self.rank = rank
        self.value = value
        self.repeat = repeat
        self.every = every
        self.param = param
        self.digest_dir = Path(digest_dir) if digest_dir else None
        self.injected: list[int] = []

    def _due(self, step: int) -> bool:
        after = step - self.step
        return after == 0 or (self.repeat and after > 0 and after % self.every == 0)

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        from engine.distributed import unwrap

        model = unwrap(ctx.model)
        if self.digest_dir is not None:
            self.digest_dir.mkdir(parents=True, exist_ok=True)
            line = json.dumps({"step": step, "digest": param_digest(model)})
            with (self.digest_dir / f"rank{_rank()}.jsonl").open("a") as f:
                f.write(line + "\n")
        if self._due(step + 1) and (self.rank is None or self.rank == _rank()):
            poison_next_backward(dict(model.named_parameters())[self.param], self.value)
            self.injected.append(step + 1)


class DetachEmbeddingStep:
    """The default accumulation step, but with `pos_emb`'s output detached from the graph.

    `pos_emb.weight` still requires grad yet never receives one: the mistake the trainer's
    missing-gradient warning exists to catch.
    """

    def __init__(self, module: str = "pos_emb") -> None:
        from engine.steps.accumulate import AccumulateStep

        self.module = module
        self.inner: Callable[[StepContext, Sequence[Batch]], StepResult] = AccumulateStep()

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        from engine.distributed import unwrap

        target = getattr(unwrap(ctx.model), self.module)
        handle = target.register_forward_hook(lambda _m, _args, out: out.detach())
        try:
            return self.inner(ctx, window)
        finally:
            handle.remove()
