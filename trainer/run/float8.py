"""`train.precision=fp8`: the model's Linear layers converted to torchao's float8 training
(engine/numerics/float8.py) before the layout wraps them, with the trainer's refusals: a
device without float8 matmuls (unless `train.fp8_emulate=true`) and tensor parallelism."""

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
    """fp8's refusals, before the model is converted: the device, and tensor parallelism
    (torchao shards float8 layers with its own plans, which `dist.tp` does not use)."""
    why = unsupported(info.device)
    if why is not None and not train.fp8_emulate:
        raise ConfigError(
            "train.precision",
            f"fp8 trains Linear layers with float8 matmuls, which need a CUDA GPU of compute "
            f"capability 8.9 or later (Ada, Hopper); {why}. Valid here: {OTHERS} (bf16 is "
            "the fast choice); train.fp8_emulate=true emulates float8 on this device to check "
            "fp8's numerics (slow, for checking only)",
        )
    if dims.tp > 1:
        raise ConfigError(
            "train.precision",
            f"fp8 is not available with dist.tp={dims.tp}: float8 layers need torchao's own "
            f"tensor-parallel plans, not built yet; use dist.tp=1, or {OTHERS} with dist.tp",
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
