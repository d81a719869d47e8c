"""`train.precision=fp8`: float8 training of a model's Linear layers through torchao
(`torchao.float8.convert_to_float8_training`), everything else under bf16 autocast as `bf16`.

Which layers: plain `nn.Linear`s (not a subclass: a fake-quantized or adapter layer keeps its
own forward) whose input and output sizes are both multiples of 16, what float8 matmuls
need. The output head stays in bf16 (the loss reads its weight, tied to the embedding; the
logits' precision is the loss's), and so do a mixture's routers (a few outputs decide which
expert a token goes to). Embeddings, norms and a mixture's batched expert weights are not
Linear layers: bf16 autocast, as `bf16`. `Float8Layers.describe()` names what stayed.

torchao is an optional dependency (the extra `fp8`), imported only here and only when
converting. Real float8 matmuls need a CUDA GPU of compute capability 8.9 or later (Ada,
Hopper); `emulate=True` computes the same casts in higher precision on any device: slow,
for checking numerics on a CPU only. Checkpoints are unchanged: a converted layer keeps its
`weight` and `bias` parameters in their dtype, under their names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.dependency_noise import silence_dependency_noise
from engine.numerics import FP8_INSTALL

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later
ALIGN = 16  # float8 matmuls need both dimensions of a weight to be multiples of this


def unsupported(device: torch.device) -> str | None:
    """Why `device` has no float8 matmuls (None when it has them)."""
    if device.type != "cuda":
        return f"a {device.type} device has no float8 matmuls"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"{name} has compute capability {capability[0]}.{capability[1]}; float8 matmuls "
            f"need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (Ada, Hopper)"
        )
    return None


@dataclass(frozen=True)
class Float8Layers:
    """What `convert` did: the Linear layers it converted, and why each other one stayed in
    bf16 (by qualified name)."""

    converted: tuple[str, ...]
    kept: Mapping[str, str] = field(default_factory=dict)
    emulated: bool = False

    def describe(self) -> str:
        """One line for the run's banner, e.g. `fp8 (float8 Linear layers: 8 of 9; kept in
        bf16: lm_head (output head))`."""
        total = len(self.converted) + len(self.kept)
        kept = "; kept in bf16: " + ", ".join(f"{k} ({why})" for k, why in self.kept.items())
        return (
            f"fp8 (float8 Linear layers: {len(self.converted)} of {total}"
            + (kept if self.kept else "")
            + ("; emulated: slow, for checking only" if self.emulated else "")
            + ")"
        )


def plan(
    model: nn.Module, keep: Mapping[nn.Module, str]
) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """The plain Linear layers of `model` to convert (by qualified name), and those to keep
    in bf16 with the reason: `keep`'s own modules (and every Linear inside them), and layers
    whose sizes are not multiples of 16."""
    convert: dict[str, nn.Linear] = {}
    kept: dict[str, str] = {}
    inside: dict[nn.Module, str] = {}
    for module, why in keep.items():
        for sub in module.modules():
            inside.setdefault(sub, why)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module in inside:
            kept[name] = inside[module]
        elif type(module) is not nn.Linear:
            kept[name] = f"a {type(module).__name__}, not a plain Linear"
        elif module.in_features % ALIGN or module.out_features % ALIGN:
            kept[name] = f"{module.in_features} x {module.out_features}: not multiples of {ALIGN}"
        else:
            convert[name] = module
    return convert, kept


def convert(model: nn.Module, keep: Mapping[nn.Module, str], *, emulate: bool) -> Float8Layers:
    """Swap `model`'s plain Linear layers for torchao's `Float8Linear` in place (before
    activation checkpointing, compilation and sharding wrap them), except `keep`'s and those
    whose sizes float8 matmuls cannot take (`plan`).

    Raises:
        ModuleNotFoundError: torchao is not installed (the message names the extra).
    """
    silence_dependency_noise()  # engine users without trainer: torchao's import-time lines
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ModuleNotFoundError(
            f"train.precision=fp8 needs torchao, which is not installed: {FP8_INSTALL}"
        ) from None
    chosen, kept = plan(model, keep)
    wanted = set(chosen.values())
    convert_to_float8_training(
        model,
        config=Float8LinearConfig(emulate=emulate),
        module_filter_fn=lambda module, name: module in wanted,
    )
    return Float8Layers(tuple(chosen), kept, emulate)
