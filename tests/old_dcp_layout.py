"""The optimizer layouts of older `sharded` checkpoints, written by the old code:

- `old_state`, cumulus before the flattened optimizer state: `get_state_dict`'s default
  (nested) optimizer state dict, whose `param_groups` DCP keys by group index and saves from
  one rank. `python -m tests.old_dcp_layout [overrides]` is `trainer.train` writing it.
- `flat_state`, cumulus before settings were written once: `get_state_dict`'s flattened
  optimizer state dict, every setting of every parameter its own key.

For tests that old sharded checkpoints still load and resume (tests/test_pipeline.py,
tests/test_sharded_checkpoint.py). These are the old code, not modes of the engine's:
`engine.checkpoint.sharded` only reads those layouts.
"""

from __future__ import annotations

import runpy
from typing import Any

import torch

import engine.checkpoint.sharded


def old_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
) -> dict[str, Any]:
    """(`trainable_only`, adapters' checkpoints of the trainable parameters alone, came after
    this layout: whole models only.)"""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    assert not trainable_only

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def flat_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
) -> dict[str, Any]:
    """`engine.checkpoint.sharded.sharded_model_optimizer_state` as it was (flattened, nested
    where the optimizer's state cannot be flattened)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from engine.checkpoint.trainable import without_frozen

    def options(flat: bool) -> StateDictOptions:
        return StateDictOptions(
            flatten_optimizer_state_dict=flat,
            ignore_frozen_params=trainable_only,
            strict=not trainable_only,
        )

    try:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options(True))
    except NotImplementedError:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options(False))
    if trainable_only:
        model_state = without_frozen(model, model_state)
    return {"model": model_state, "optimizer": optimizer_state}


if __name__ == "__main__":
    # trainer.run.state imports the function when it saves: patching the module attribute is enough.
    engine.checkpoint.sharded.sharded_model_optimizer_state = old_state  # type: ignore[assignment]
    runpy.run_module("trainer.train", run_name="__main__", alter_sys=True)
