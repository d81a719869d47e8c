"""`task=dpo` in the run: its reference model, chosen and attached before the policy is laid
out (after fp8's conversion: a copy is then float8 as the policy is), laid out like the
policy, or precomputed (`task.reference=precomputed`: the file keyed before the layout, the
pass on the laid-out model). What it refuses is the compatibility table's
(trainer/run/compatibility.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
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
from trainer.config.schema import Config
from trainer.data.preference import PreferenceSamples
from trainer.models.lora import Adapter
from trainer.run.extensions.base import Extension
from trainer.run.layout import parallelize, parameter_dtype
from trainer.run.parts import Parts
from trainer.tracking.plurals import counted


def attach_reference(task: object, model: nn.Module, adapter: Adapter | None) -> None:
    """`task.reference` of a DPO task, built and given to it before the model is laid out
    over the ranks: `copy` (the default without an adapter) copies the initial policy,
    frozen; `adapter` (the default under adapter=lora) scores with the base, its adapters
    disabled; `precomputed` (scored after layout) and `none` (simpo) attach no model. Any
    other task: nothing to do."""
    if not isinstance(task, DPOTask) or task.reference in ("none", "precomputed"):
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


def lay_out_reference(
    task: object, parallel: Parallelism, apply: Callable[[nn.Module], nn.Module], is_main: bool
) -> None:
    """After the policy is laid out: a frozen copy is sharded like it under FSDP2 (`apply`
    lays a module out as the policy was), so no rank holds a whole second model; one line
    says where the reference lives."""
    if not isinstance(task, DPOTask) or task.reference_mode in ("none", "precomputed"):
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
        mode = task.reference_mode
        print(f"task.reference={mode}: {where[mode]}", flush=True)


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
    chunks: list[list[int]],
    collate: Any,
    precision: str,
    device: torch.device,
) -> np.ndarray:
    """(pairs, 2) float64: the summed answer log-probabilities of the pairs of `chunks` (lists
    of rows; an empty list: a chunk run and dropped, so that a collective forward sees every
    rank), in eval mode under the run's autocast (`precision`), as the step scores the
    policy: at step 1 the two then cancel exactly, as a copy's do."""
    out = []
    for rows in chunks:
        batch = collate([samples[i] for i in (rows or range(min(1, len(samples))))])
        batch = {k: v.to(device) for k, v in batch.items()}
        with Precision(precision, device.type).autocast():
            scored = task.log_probs(model, batch)[0].double().cpu()
        if rows:
            out.append(scored)
    return torch.cat(out).numpy() if out else np.zeros((0, 2))


def my_chunks(n: int, micro: int, dp_rank: int, dp_size: int) -> list[list[int]]:
    """This rank's rows of `n` pairs, chunk by chunk: chunks of `micro` consecutive pairs,
    chunk c on data-parallel rank c % dp_size (the ranks of one tensor-parallel group run the
    same chunk through their split layers, together), in rounds of one chunk per
    data-parallel rank (an empty list where a rank has none left in the last round), so that
    every rank runs as many forwards."""
    starts = range(0, n, micro)
    rounds = -(-len(starts) // dp_size)
    mine = [
        starts[c] if c < len(starts) else None for c in range(dp_rank, rounds * dp_size, dp_size)
    ]
    return [[] if at is None else list(range(at, min(at + micro, n))) for at in mine]


@dataclass(frozen=True)
class ReferenceFile:
    """Where task.reference=precomputed's values live (the data's token cache, under a key of
    the initial model, the pairs, the chunk size and the precision) and how they are
    scored; `path` None: trainer.plan's fake model, whose pass is zeros of the pairs'
    shape."""

    path: Path | None
    micro: int
    precision: str


def reference_file(
    task: object,
    model: nn.Module,
    data: Any,
    micro: int,
    precision: str = "fp32",
    planned: bool = False,
    low_precision_parameters: bool = False,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
) -> ReferenceFile | None:
    """`task.reference=precomputed`, before the model is laid out (the initial model is whole
    on each rank then): the file its values are kept in, keyed to the model's fingerprint, the
    pairs (store, rows, lengths, layout), `micro` and `precision`, and what of the layout
    changes the values: `low_precision_parameters` (the layout computes with bf16 parameters,
    `trainer.run.assemble.parameter_dtype`: FSDP2's under bf16 or fp8) and `tensor_parallel`
    (its degree above 1: split matmuls add their partial products in another order; and
    `sequence_parallel`, whose norms and gathers run on sequence shards).
    `planned` (trainer.plan: the model is fake tensors): no file (zeros of the pairs' shape,
    no pass). Any other task: None."""
    if not isinstance(task, DPOTask) or task.reference != "precomputed":
        return None
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
        return ReferenceFile(None, micro, precision)
    ident: dict[str, Any] = {"model": model_key(model), "micro": micro, "precision": precision}
    if low_precision_parameters:
        ident["parameters"] = "bf16"
    if tensor_parallel > 1:
        ident["tp"] = tensor_parallel
        if sequence_parallel:
            ident["tp_sequence_parallel"] = True
    ident |= {k: v.identity() for k, v in splits.items()}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return ReferenceFile(Path(data.train.store.root) / "reference" / f"{key}.pt", micro, precision)


def layout_reference_file(
    cfg: Config,
    task: object,
    model: nn.Module,
    data: Any,
    dims: ParallelDims,
    info: DistInfo,
    planned: bool = False,
) -> ReferenceFile | None:
    """`task.reference=precomputed`'s file (`reference_file`) for this run's layout:
    keyed to the initial model, whole here (fp8's conversion keeps the names), the run's
    micro-batch (1 under auto) and precision, the bf16 parameters the layout computes with
    (`parameter_dtype`, as `parallelize` lays out), its tensor-parallel degree and whether
    that is sequence-parallel."""
    micro = cfg.train.micro_batch_size
    return reference_file(
        task,
        model,
        data,
        micro if micro != "auto" else 1,
        precision=cfg.train.precision,
        planned=planned,
        low_precision_parameters=parameter_dtype(cfg.train.precision, dims, info) is not None,
        tensor_parallel=dims.tp,
        sequence_parallel=dims.sequence_parallel,
    )


def precompute_reference(
    file: ReferenceFile | None,
    task: object,
    model: nn.Module,
    data: Any,
    info: DistInfo,
    parallel: Parallelism,
) -> dict[str, np.ndarray] | None:
    """`task.reference=precomputed` (`file`: see `reference_file`), after the model is laid
    out: every pair's reference log-probabilities (chosen, rejected), (pairs, 2) of the train
    and of the validation pairs, under the initial model as the run lays it out (FSDP2:
    sharded, every rank in each forward), for the data to carry with each batch.

    The pairs are scored `file.micro` consecutive pairs at a time (the run's micro-batch; 1
    under auto), chunk c on data-parallel rank c % dp (`parallel`'s coordinates: a
    tensor-parallel group scores one chunk together), in rounds where every rank scores one
    chunk (a rank without one left runs a chunk and drops it: a sharded or split forward is
    collective), and the reporting ranks' shares are gathered: the pass takes 1/dp of the
    time, every rank ends with all the values (no rank waits on another's file), and the
    values do not depend on the number of data-parallel ranks (a chunk is the same batch on
    any rank), so runs of other layouts writing the same key write the same bits. Rank 0
    writes them, once the pass is complete, to a temporary file renamed when whole, so an
    interrupted pass leaves nothing. A later start of the same base on the same pairs (a
    resumed run) reads the file; another base computes anew. None without a file."""
    if file is None:
        return None
    assert isinstance(task, DPOTask)
    splits = {"train": data.train, "val": data.val}
    path = file.path
    if path is None:  # the planner's fake model: the shapes alone
        return {k: np.zeros((len(v), 2)) for k, v in splits.items()}
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
                chunks = my_chunks(len(samples), file.micro, parallel.dp_rank, parallel.dp_size)
                part = _score(
                    task, model, samples, chunks, data.collate_fn, file.precision, info.device
                )
                # A tensor-parallel group's ranks computed the same values: the first's count.
                mine = [i for rows in chunks for i in rows] if parallel.reports else []
                table = np.zeros((len(samples), 2))
                for rows, vals in all_gather_object((mine, part[: len(mine)]), info):
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
    if info.is_main:
        n = sum(len(v) for v in splits.values())
        how = "read from" if reused else "computed (each rank its share) and written to"
        print(
            "task.reference=precomputed: the initial model's log-probabilities of "
            f"{counted(n, 'pair')} {how} {path}",
            flush=True,
        )
    return values


class Preference(Extension):
    """task=dpo's reference: attached and keyed before the layout, laid out and precomputed
    after it (a no-op for any other task)."""

    name = "dpo"

    def __init__(self) -> None:
        self.file: ReferenceFile | None = None  # precomputed: keyed before, scored after

    def before_layout(self, parts: Parts) -> Parts:
        # The initial policy, after fp8's conversion (a copy is then float8 as the policy
        # is: at step 1 the two cancel).
        attach_reference(parts.task, parts.built_model(), parts.adapter)
        # (the planner's model is fake tensors: no pass)
        self.file = layout_reference_file(
            parts.cfg,
            parts.task,
            parts.built_model(),
            parts.data,
            parts.dims,
            parts.info,
            parts.simulated,
        )
        return parts

    def after_layout(self, parts: Parts) -> Parts:
        assert parts.model_extras is not None
        extras, parallel, dtype = parts.model_extras, parts.parallel, parts.param_dtype
        with parts.building:
            lay_out_reference(
                parts.task,
                parallel,
                lambda ref: parallelize(ref, extras, parallel, param_dtype=dtype),
                parts.info.is_main and not parts.simulated,
            )
        # The pass scores with the model as the run lays it out (FSDP2: sharded, so a model
        # that fits only sharded precomputes too).
        data = parts.data
        values = precompute_reference(
            self.file, parts.task, parts.built_model(), data, parts.info, parallel
        )
        if values is None:
            return parts
        train, val = (
            data.train.with_reference(values["train"]),
            data.val.with_reference(values["val"]),
        )
        return parts.replace(data=dataclasses.replace(data, train=train, val=val))
