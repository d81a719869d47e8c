"""`task=dpo` in the run's assembly: the layouts and data it takes (refused otherwise, in one
paragraph naming the key), and its reference model, chosen and attached."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from engine.parallel.base import Parallelism
from engine.parallel.dims import ParallelDims
from engine.preference import DPOTask, adapters_disabled, frozen_copy
from trainer.config.errors import ConfigError
from trainer.models.lora import Adapter

PAIRS_DATA = "trainer.data.preference.preference_data"
DPO_TASK = "engine.preference.DPOTask"


def check_pairs_layout(task_node: dict, dims: ParallelDims) -> None:
    """task=dpo under sequence or pipeline splits: refused before anything is built."""
    if task_node.get("_target_") != DPO_TASK:
        return
    for key, degree in (("dist.cp", dims.cp), ("dist.pp", dims.pp)):
        if degree > 1:
            raise ConfigError(
                key,
                f"task=dpo is not available with {key}={degree}: a pair's loss needs the summed "
                "log-probabilities of both its sequences, each whole on one rank, and splitting "
                "sequences over ranks (cp) or the model into stages (pp) is not built for "
                "pairs. Use dist.strategy=ddp or fsdp",
            )


def check_pairs_task(task: object, data_target: str | None) -> None:
    """data=preference's batches are whole pairs (pairs, 2, positions): only a preference
    task reads them."""
    if data_target == PAIRS_DATA and not isinstance(task, DPOTask):
        raise ConfigError(
            "task",
            f"data=preference gives pairs of a chosen and a rejected answer, which train with "
            f"task=dpo (task.loss_type=sigmoid|ipo|simpo); {type(task).__name__} reads other "
            "batches. Select task=dpo, or data=chat to fine-tune on the conversations",
        )


def attach_reference(task: object, model: nn.Module, adapter: Adapter | None) -> None:
    """`task.reference` of a DPO task, before the model is laid out over the ranks: `copy`
    (the default without an adapter) copies the initial policy, frozen; `adapter` (the
    default under adapter=lora) scores with the base, its adapters disabled; `none` (simpo)
    has no reference. Any other task: nothing to do."""
    if not isinstance(task, DPOTask) or task.reference == "none":
        return
    mode = task.reference or ("adapter" if adapter is not None else "copy")
    if mode == "adapter":
        if adapter is None:
            raise ConfigError(
                "task.reference",
                "adapter scores the reference as the policy's base with its adapters disabled, "
                "and this run has no adapter (adapter=none): select adapter=lora, or "
                "task.reference=copy (a frozen copy of the initial model)",
            )
        task.attach_reference(adapters_disabled(adapter.peft_model, model))
    else:
        task.attach_reference(frozen_copy(model))
    task.reference = mode


def lay_out_reference(
    task: object, parallel: Parallelism, apply: Callable[[nn.Module], nn.Module], is_main: bool
) -> None:
    """After the policy is laid out: a frozen copy is sharded like it under FSDP2 (`apply`
    lays a module out as the policy was), so no rank holds a whole second model; one line
    says where the reference lives."""
    if not isinstance(task, DPOTask) or task.reference == "none":
        return
    ref = task.frozen_copy
    sharded = parallel.shards_parameters and parallel.name == "fsdp"
    if ref is not None and sharded:
        ref.lay_out(apply)
    if is_main:
        where = {
            "adapter": "the base with its adapters disabled (no copy of the weights)",
            "copy": "a frozen copy of the initial model, "
            + ("sharded like the policy" if sharded else "whole on each rank"),
        }
        print(f"task.reference={task.reference}: {where[task.reference]}", flush=True)
