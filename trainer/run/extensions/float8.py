"""`train.precision=fp8` in the run: the model's Linear layers converted to torchao's float8
training (engine/numerics/float8.py) before the layout wraps them (and before DPO's reference
is copied from the model: a copy is then float8 too), with fp8's own refusals: a device
without float8 matmuls (unless `train.fp8_emulate=true`)."""

from __future__ import annotations

from torch import nn

from engine.distributed import DistInfo
from engine.moe.routing import HasRouters, HookedRouter
from engine.numerics import PRECISIONS
from engine.numerics.chunked_ce import OutputHead
from engine.numerics.float8 import Float8Layers, convert, plan, unsupported
from engine.parallel.dims import ParallelDims
from trainer.config.errors import ConfigError
from trainer.config.schema import TrainCfg
from trainer.run.extensions.base import Extension
from trainer.run.parts import Parts

OTHERS = ", ".join(p for p in PRECISIONS if p != "fp8")


def kept_in_bf16(model: nn.Module) -> dict[nn.Module, str]:
    """The modules whose Linear layers stay in bf16 whatever their sizes: the output head
    (the loss reads its weight) and a mixture's routers."""
    keep: dict[nn.Module, str] = {}
    if isinstance(model, OutputHead):
        keep[model.output_head()] = "output head"
    for router in model.routers() if isinstance(model, HasRouters) else []:
        module = router.module if isinstance(router, HookedRouter) else router
        if isinstance(module, nn.Module):
            keep[module] = "router"
    return keep


def check_float8(train: TrainCfg, info: DistInfo, dims: ParallelDims) -> None:
    """fp8's own refusal, before the model is converted: a device without float8 matmuls
    (fp8 with tensor parallelism is the compatibility table's)."""
    why = unsupported(info.device)
    if why is not None and not train.fp8_emulate:
        raise ConfigError(
            "train.precision",
            f"fp8 trains Linear layers with float8 matmuls, which need a CUDA GPU of compute "
            f"capability 8.9 or later (Ada, Hopper); {why}. Valid here: {OTHERS} (bf16 is "
            "the fast choice); train.fp8_emulate=true emulates float8 on this device to check "
            "fp8's numerics (slow, for checking only)",
        )


def to_float8(
    model: nn.Module, train: TrainCfg, info: DistInfo, dims: ParallelDims
) -> Float8Layers:
    """Convert `model`'s Linear layers for fp8 in place (after `check_float8`'s refusals); a
    model with none to convert is refused (fp8 would silently be bf16)."""
    check_float8(train, info, dims)
    keep = kept_in_bf16(model)
    chosen, kept = plan(model, keep)
    if not chosen:
        why = "; ".join(f"{name}: {reason}" for name, reason in kept.items())
        raise ConfigError(
            "train.precision",
            f"fp8 found no Linear layer of {type(model).__name__} to train in float8 (plain "
            f"nn.Linear layers whose sizes are multiples of 16, besides the output head and "
            f"routers){'; ' + why if why else ': it has no nn.Linear'}. Valid for this "
            f"model: {OTHERS}",
        )
    try:
        return convert(model, keep, emulate=train.fp8_emulate)
    except ModuleNotFoundError as exc:  # torchao vanished since the config's check
        raise ConfigError("train.precision", str(exc)) from None


class Float8(Extension):
    """The model converted before the layout (`parts.float8`); the planner's fake model plans
    as bf16, not converted."""

    name = "fp8"

    def before_layout(self, parts: Parts) -> Parts:
        if parts.cfg.train.precision != "fp8" or parts.simulated:
            return parts
        with parts.building:
            layers = to_float8(parts.built_model(), parts.cfg.train, parts.info, parts.dims)
        return parts.replace(float8=layers)
