"""Mixed precision: autocast for forward + loss, GradScaler for fp16, and the update that is
skipped when gradients are not finite."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from engine.numerics import PRECISIONS

# fp8: the Linear layers torchao converted compute in float8 (engine/numerics/float8.py); the
# rest runs under bf16 autocast, as bf16, and needs no loss scaler either.
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class Precision:
    """Owns autocast, the loss scaler and the skip-on-non-finite optimizer update.

    Args:
        mode: `fp32`, `bf16` (autocast), `fp16` (autocast + GradScaler) or `fp8` (bf16
            autocast around Linear layers converted by `engine.numerics.float8.convert`).
        device_type: `cpu` or `cuda`; autocast and the scaler run on this device type.
    """

    def __init__(self, mode: str, device_type: str) -> None:
        if mode not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {mode!r}")
        self.mode = mode
        self.device_type = device_type
        self.dtype = _DTYPES[mode]
        self.scaler = torch.amp.GradScaler(device_type) if mode == "fp16" else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype is None:
            yield
        else:
            with torch.autocast(self.device_type, dtype=self.dtype):
                yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide gradients by the loss scale in place, so clipping and logging see true values."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """Apply the update unless `found_inf` (a 0/1 float tensor) is set.

        With GradScaler the scaler decides (it also lowers the scale). Otherwise fused
        optimizers take `found_inf` on the device and skip without a host sync; others need
        one host read of the flag.
        """
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        elif not bool(found_inf.item()):
            optimizer.step()

    def found_inf_flags(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """After `unscale_`: the scaler's own overflow flags for `optimizer` (one per device),
        for a caller that must agree on them across ranks holding different parameters
        (pipeline stages). Empty without a scaler."""
        if self.scaler is None:
            return []
        state = self.scaler._per_optimizer_states[id(optimizer)]
        return list(state["found_inf_per_device"].values())

    def loss_scale(self) -> torch.Tensor | None:
        """Current loss scale as a device tensor (no sync), or None without a scaler."""
        if self.scaler is None:
            return None
        return self.scaler._get_scale_async()  # the public get_scale() syncs

    def window_state(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The scaler's scale and growth tracker as device copies (no host sync, unlike
        `state_dict`), for `restore_window_state` when a window is redone; None without a
        scaler or before its first use (`scale()` initialises them lazily)."""
        if self.scaler is None or self.scaler._scale is None:
            return None
        return self.scaler._scale.clone(), self.scaler._growth_tracker.clone()

    def restore_window_state(self, saved: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Back to `saved` (from `window_state`), and forget that the window's gradients were
        unscaled or stepped: the redone window unscales its own."""
        if self.scaler is None:
            return
        if saved is None:  # before its first use: initialised again by the next scale()
            self.scaler._scale = self.scaler._growth_tracker = None
        else:
            self.scaler._scale.copy_(saved[0])
            self.scaler._growth_tracker.copy_(saved[1])
        self.scaler._per_optimizer_states.clear()  # a defaultdict: refreshed on next use

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Switching precision on resume is allowed; the scale carries over only fp16 -> fp16.
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
