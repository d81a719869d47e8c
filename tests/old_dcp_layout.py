"""`python -m tests.old_dcp_layout [overrides]`: `trainer.train` writing `sharded` checkpoints
in the layout of cumulus before the flattened optimizer state: `get_state_dict`'s default
(nested) optimizer state dict, whose `param_groups` DCP keys by group index and saves from
one rank.

For tests that old sharded checkpoints still resume (tests/test_pipeline.py). This is the old
code, not a mode of the engine's: `engine.checkpoint.sharded` only reads that layout.
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


if __name__ == "__main__":
    # trainer.run.state imports the function when it saves: patching the module attribute is enough.
    engine.checkpoint.sharded.sharded_model_optimizer_state = old_state  # type: ignore[assignment]
    runpy.run_module("trainer.train", run_name="__main__", alter_sys=True)
