"""Checkpoints of the trainable parameters alone (adapters on a frozen base): which keys such a
checkpoint must hold, checked on load, since loading it leaves every other parameter as the
model was built (the frozen base) and so cannot rely on a strict `load_state_dict`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def frozen_names(model: torch.nn.Module) -> set[str]:
    """Every name a frozen parameter has, a tied weight's other names included (torch's
    `ignore_frozen_params` drops only the first: GPT-2's frozen `lm_head.weight`, which is
    `wte.weight`, would stay in an adapters' checkpoint)."""
    params = model.named_parameters(remove_duplicate=False)
    return {name for name, p in params if not p.requires_grad}


def without_frozen(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a model's, keyed by parameter name) without any frozen parameter."""
    frozen = frozen_names(model)
    return {k: v for k, v in state.items() if k not in frozen}


def trainable_state_keys(model: torch.nn.Module) -> set[str]:
    """The keys of `model`'s state without its frozen parameters (buffers included), as a
    checkpoint of the trainable parameters holds them; no communication."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(ignore_frozen_params=True)
    return set(without_frozen(model, get_model_state_dict(model, options=options)))


def check_trainable_keys(model: torch.nn.Module, saved: Iterable[str]) -> None:
    """A checkpoint of the trainable parameters must hold exactly `model`'s: a missing one
    would keep its fresh value, an extra one (an adapter on a module this model has none on)
    would be dropped. Raises ValueError naming the first few of either."""
    want, got = trainable_state_keys(model), set(saved)
    missing, extra = sorted(want - got), sorted(got - want)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"it lacks {len(missing)} trainable tensor(s) ({', '.join(missing[:3])})")
        if extra:
            parts.append(
                f"it holds {len(extra)} that this model does not train ({', '.join(extra[:3])})"
            )
        raise ValueError("; ".join(parts))
