"""`task=dpo` in the run's assembly: the layouts and data it takes (refused otherwise, in one
paragraph naming the key), and its reference model, chosen and attached."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.checkpoint.fingerprint import row_sums
from engine.distributed import DistInfo, all_gather_object
from engine.numerics.precision import Precision
from engine.parallel.base import Parallelism
from engine.parallel.dims import ParallelDims
from engine.preference import DPOTask, adapters_disabled, frozen_copy
from trainer.config.errors import ConfigError
from trainer.data.preference import PreferenceSamples
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
    if mode == "precomputed":  # written by precompute_reference, before layout
        task.attach_reference(None)
    elif mode == "adapter":
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
    if not isinstance(task, DPOTask) or task.reference in ("none", "precomputed"):
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


def model_key(model: nn.Module) -> str:
    """The initial model's fingerprint (engine/checkpoint/fingerprint.py's row sums of every
    parameter, hashed): another base, or another initialization, is another key."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        digest.update(row_sums(p).numpy().tobytes())
    return digest.hexdigest()[:24]


@torch.no_grad()
def _score(
    task: DPOTask,
    model: nn.Module,
    samples: PreferenceSamples,
    rows: list[int],
    collate: Any,
    micro: int,
    precision: str,
) -> np.ndarray:
    """(len(rows), 2) float64: the summed answer log-probabilities of pairs `rows` under
    `model`, `micro` pairs at a time, in eval mode under the run's autocast (`precision`), as
    the step scores the policy: at step 1 the two then cancel exactly, as a copy's do."""
    device = next(model.parameters()).device
    out = []
    for at in range(0, len(rows), micro):
        batch = collate([samples[i] for i in rows[at : at + micro]])
        batch = {k: v.to(device) for k, v in batch.items()}
        with Precision(precision, device.type).autocast():
            out.append(task.log_probs(model, batch)[0].double().cpu())
    return torch.cat(out).numpy() if out else np.zeros((0, 2))


def precompute_reference(
    task: object,
    model: nn.Module,
    data: Any,
    info: DistInfo,
    micro: int,
    precision: str = "fp32",
    planned: bool = False,
) -> None:
    """`task.reference=precomputed`: every pair's reference log-probabilities (chosen,
    rejected), of the train and validation pairs, under the initial model (before it is laid
    out, whole on each rank), attached to the data so that each batch carries its pairs'.

    The pairs are scored `micro` consecutive pairs at a time (the run's micro-batch; 1 under
    auto), chunk c on rank c % world, and the shares are gathered: the pass takes 1/world of
    the time, every rank ends with all the values (no rank waits on another's file), and the
    values do not depend on the number of ranks (a chunk is the same batch on any rank), so
    runs of other layouts writing the same key write the same bits. Rank 0 writes them to
    the data's token cache, keyed to the model's fingerprint, the pairs (store, rows,
    lengths, layout) and `micro`: to a temporary file renamed when whole, so an interrupted
    pass leaves nothing. A later start of the same base on the same pairs (a resumed run)
    reads the file; another base computes anew. `planned` (trainer.plan: the model is fake
    tensors): zeros, the batches' shapes without a pass. Any other task: nothing to do."""
    if not isinstance(task, DPOTask) or task.reference != "precomputed":
        return
    splits = {"train": data.train, "val": data.val}
    for split, samples in splits.items():
        if not isinstance(samples, PreferenceSamples) or data.collate_fn is None:
            raise ConfigError(
                "task.reference",
                f"precomputed writes each pair's reference log-probabilities for data="
                f"preference, and the {split} set is {type(samples).__name__}: use data="
                "preference, or task.reference=copy",
            )
    if planned:
        for samples in splits.values():
            samples.reference = np.zeros((len(samples), 2))
        return
    ident = {"model": model_key(model), "micro": micro, "precision": precision}
    ident |= {k: v.identity() for k, v in splits.items()}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    path = Path(data.train.store.root) / "reference" / f"{key}.pt"
    values: dict[str, np.ndarray] | None = None
    if all(all_gather_object(path.is_file(), info)):
        stored = torch.load(path, weights_only=True)
        values = {k: stored[k].numpy() for k in splits}
        if any(values[k].shape != (len(v), 2) for k, v in splits.items()):
            values = None  # not these pairs after all: computed anew
    reused = values is not None
    if values is None:
        training = {m: m.training for m in model.modules()}
        model.eval()
        try:
            values = {}
            for split, samples in splits.items():
                chunks = range(info.rank * micro, len(samples), info.world_size * micro)
                mine = [i for c in chunks for i in range(c, min(c + micro, len(samples)))]
                part = _score(task, model, samples, mine, data.collate_fn, micro, precision)
                table = np.zeros((len(samples), 2))
                for rows, vals in all_gather_object((mine, part), info):
                    table[rows] = vals
                values[split] = table
        finally:
            for m, mode in training.items():
                m.train(mode)
        if info.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            torch.save({k: torch.from_numpy(v) for k, v in values.items()}, tmp)
            os.replace(tmp, path)
    for split, samples in splits.items():
        samples.reference = values[split]
    if info.is_main:
        n = sum(len(v) for v in splits.values())
        how = "read from" if reused else "computed (each rank its share) and written to"
        print(
            f"task.reference=precomputed: the initial model's log-probabilities of {n} pairs "
            f"{how} {path}",
            flush=True,
        )
