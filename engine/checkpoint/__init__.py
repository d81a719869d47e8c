"""Atomic, verifiable, safe-to-load checkpoints: the API in one import.

Layout of one checkpoint (a directory named after its optimizer step):

    step_00000100/
        state.pt        scheduler, scaler, counters, run id, config, and in the `full` layout
                        the whole model and optimizer state
        rank_00000.pt   each rank's RNG states (one file per rank)
        shards/         `sharded` layout only: model and optimizer state as DCP files, each
                        rank's own shards (`engine.checkpoint.sharded`)
        manifest.json   layout, sizes and SHA-256 of every file above; written last

`full`: rank 0 gathers the unsharded state and writes every file. `sharded`: every rank
writes its shards in parallel (nothing is gathered; the run directory must be on a filesystem
all ranks share), hashes its share of the files, and rank 0 writes the rest. Either way the
files go under a temporary name, are fsynced, and one `rename` of the directory by rank 0
commits them, so a checkpoint is complete or absent. Loading checks the manifest first and
unpickles nothing but tensors and plain containers (`torch.load(weights_only=True)`, and an
allow-list for DCP's metadata).

The pieces, imported one way: `engine.checkpoint.manifest` (names, manifest, verification,
safe loading) <- `engine.checkpoint.writer` (staging, commit, the writer and its failure
agreement) <- `engine.checkpoint.sharded` (the DCP layout, imported only where a sharded
checkpoint is written or read: DCP is slow to import).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.checkpoint.manifest import (
    MANIFEST,
    SHARDS,
    SHARED,
    CheckpointError,
    LoadedCheckpoint,
    UnsafeCheckpoint,
    checkpoint_name,
    latest_valid,
    list_checkpoints,
    load_checkpoint,
    rank_file,
    safe_load,
    verify,
    verify_together,
)
from engine.checkpoint.trainable import (
    check_trainable_keys,
    trainable_state_keys,
    without_frozen,
)
from engine.checkpoint.writer import (
    CheckpointWriteError,
    CheckpointWriter,
    cpu_copy,
    remove_stale_tmp,
    write_checkpoint,
)

__all__ = [
    "MANIFEST",
    "SHARDS",
    "SHARED",
    "CheckpointError",
    "CheckpointWriteError",
    "CheckpointWriter",
    "LoadedCheckpoint",
    "UnsafeCheckpoint",
    "check_trainable_keys",
    "checkpoint_name",
    "cpu_copy",
    "latest_valid",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_optimizer_state",
    "model_optimizer_state",
    "rank_file",
    "remove_stale_tmp",
    "safe_load",
    "trainable_state_keys",
    "verify",
    "verify_together",
    "write_checkpoint",
]


def model_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full (unsharded) model and optimizer state keyed by parameter name, on the CPU.

    Collective under a process group: every rank calls it; rank 0 receives the state, other
    ranks empty dicts. The same format for one process, DDP and FSDP, so a checkpoint saved
    with any of them on N ranks resumes with any other on M ranks. `trainable_only`: the
    frozen parameters are left out (adapters on a frozen base), never gathered.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
    )
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if trainable_only:  # (a frozen tied weight's second name, gathered all the same)
        model_state = without_frozen(model, model_state)
    return model_state, optimizer_state


def load_model_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    trainable_only: bool = False,
) -> None:
    """Load full state from `model_optimizer_state` into a (possibly sharded) model;
    `trainable_only`: a state without the frozen parameters, which keep their values."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if trainable_only:
        check_trainable_keys(model, model_state)
    full = StateDictOptions(full_state_dict=True, strict=not trainable_only)
    set_model_state_dict(model, model_state, options=full)
    # An optimizer whose state holds no tensor to lay out (SGD without momentum: its
    # buffers are None) loads as it is: torch's full-state path needs one to learn the device.
    holds_tensors = any(
        isinstance(v, torch.Tensor) and v.dim() > 0
        for state in optimizer_state.get("state", {}).values()
        for v in state.values()
    )
    options = full if holds_tensors else StateDictOptions(full_state_dict=False, strict=full.strict)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
