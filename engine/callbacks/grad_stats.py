"""Gradient diagnostics: per-layer norms and parameters that never receive a gradient."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from engine.callbacks import Callback
from engine.distributed import unwrap
from engine.parallel.base import total_norm


def layer_of(name: str, depth: int = 2) -> str:
    """`blocks.3.attn.qkv.weight` -> `blocks.3`; `tok_emb.weight` -> `tok_emb`."""
    parts = name.split(".")[:-1] or name.split(".")
    if len(parts) > 1 and parts[1].isdigit():
        return ".".join(parts[:depth])
    return parts[0]


def missing_gradients(model: nn.Module) -> list[str]:
    """Names of parameters that require grad but got none: frozen by mistake, disconnected
    from the loss, or computed under `no_grad`."""
    return [n for n, p in unwrap(model).named_parameters() if p.requires_grad and p.grad is None]


class GradNormsPerLayer(Callback):
    """Pre-clip gradient norm of every layer (transformer block, embedding, head).

    Norms are computed on the device right after the window's backward; they turn into
    numbers only when a record is written.
    """

    def __init__(self, prefix: str = "grad_norm/") -> None:
        self.prefix = prefix
        self._layers: dict[str, list[nn.Parameter]] | None = None
        self._norms: dict[str, torch.Tensor] = {}

    def on_after_backward(self, ctx: Any) -> None:
        if self._layers is None:
            layers: dict[str, list[nn.Parameter]] = defaultdict(list)
            seen: set[int] = set()
            for name, p in unwrap(ctx.model).named_parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    layers[layer_of(name)].append(p)
            self._layers = dict(layers)
        self._norms = {}
        for layer, params in self._layers.items():
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                self._norms[layer] = total_norm(grads)

    def metrics(self) -> dict[str, Any]:
        return {self.prefix + k: v for k, v in self._norms.items()}
