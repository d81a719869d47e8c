"""One place that knows what a run saves: the model and optimizer, and named stateful
components (progress, scheduler, precision, callbacks, meter, and any user component with
`state_dict`/`load_state_dict`).

A checkpoint's `state.pt` holds each component's state under its name, next to the config
and, in the `full` layout, the model and optimizer. In the `sharded` layout the model and
optimizer go through DCP shards, and so do the DTensor leaves of any component's state (an
EMA sharded like the parameters): each is saved shard by shard under `state/<path>` and loaded
in place into the tensor the live component holds at the same path. Adding a component means
registering it once; saving and restoring follow.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import torch

from engine.checkpoint import (
    SHARDS,
    LoadedCheckpoint,
    load_model_optimizer_state,
    model_optimizer_state,
)
from engine.parallel.pipeline import PipelineParallel

RESERVED = ("config", "model", "optimizer")
SHARDED_STATE = "state"  # the prefix of components' DTensor leaves in DCP shards


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RunState:
    """The named stateful components of a run, in registration order."""

    def __init__(self) -> None:
        self.components: dict[str, Stateful] = {}

    def add(self, name: str, component: Any) -> None:
        """Register `component` under `name`; a component without state (no `state_dict` and
        `load_state_dict`, or None) is skipped."""
        if component is None or not isinstance(component, Stateful):
            return
        if name in RESERVED or "/" in name or name in self.components:
            raise ValueError(f"component name {name!r} is reserved or taken")
        self.components[name] = component

    def state_dict(self) -> dict[str, Any]:
        return {name: c.state_dict() for name, c in self.components.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each component's own state; a component whose state the checkpoint lacks is an
        error unless it has none to restore (e.g. a stateless callback list)."""
        for name, component in self.components.items():
            if name not in state:
                if _empty(component.state_dict()):
                    continue
                raise KeyError(f"the checkpoint holds no state for {name!r}")
            component.load_state_dict(state[name])


def _empty(state: Any) -> bool:
    if isinstance(state, dict):
        return all(_empty(v) for v in state.values())
    return state is None


def save_payload(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    components: RunState,
    sharded: bool,
    parallel: Any = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What a checkpoint writes (collective: every rank calls it): the plain part for
    `state.pt`, and in the sharded layout this rank's DCP shards. In the full layout the
    model and optimizer are gathered to rank 0 (empty elsewhere), from every pipeline stage
    when `parallel` is a pipeline."""
    state = components.state_dict()
    if not sharded:
        if isinstance(parallel, PipelineParallel):
            model_state, optimizer_state = parallel.full_state(model, optimizer)
        else:
            model_state, optimizer_state = model_optimizer_state(model, optimizer)
        return {**state, "model": model_state, "optimizer": optimizer_state}, None
    from engine.checkpoint.sharded import sharded_model_optimizer_state, split_dtensors

    shards = sharded_model_optimizer_state(model, optimizer)
    state, shards[SHARDED_STATE] = split_dtensors(state)
    return state, shards


def _sharded_targets(ckpt: LoadedCheckpoint, live: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Where to load the component tensors the checkpoint saved shard by shard: the live
    components' own tensors at the same paths (sharded or not: loading reshards). State of a
    component, or of a callback, that this run does not have is left unread."""
    from engine.checkpoint.sharded import get_path, saved_keys

    out = {}
    for key in saved_keys(ckpt.path / SHARDS, SHARDED_STATE):
        parts = key.split("/")
        try:  # a named entry this run lacks (a callback dropped on resume): skip
            get_path(live, "/".join(parts[:2]))
        except (KeyError, IndexError, TypeError):
            continue
        try:
            value = get_path(live, key)
        except (KeyError, IndexError, TypeError):
            value = None
        if not isinstance(value, torch.Tensor):
            raise KeyError(f"state {key} is in the checkpoint but not in this run")
        out[key] = value
    return out


def load_payload(
    ckpt: LoadedCheckpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    components: RunState,
    parallel: Any = None,
) -> None:
    """Collective: load the model (and optimizer, unless None) and every registered
    component from `ckpt`, resharding to this run's ranks and strategy (and pipeline
    stages: `parallel`)."""
    saved = {k: v for k, v in ckpt.shared.items() if k not in RESERVED}
    if ckpt.layout == "sharded":
        from engine.checkpoint.sharded import load_sharded, with_path

        targets = _sharded_targets(ckpt, components.state_dict())
        with getattr(parallel, "mixed_tensors", contextlib.nullcontext)():  # tensor parallel
            load_sharded(ckpt.path, model, optimizer, {SHARDED_STATE: targets})
        for key, tensor in targets.items():
            saved = with_path(saved, key, tensor)
    elif isinstance(parallel, PipelineParallel):
        optimizer_state = ckpt.shared["optimizer"] if optimizer is not None else None
        with parallel.mixed_tensors():  # stages split over tensor-parallel ranks
            parallel.load_full_state(model, optimizer, ckpt.shared["model"], optimizer_state)
    elif optimizer is None:
        model.load_state_dict(ckpt.shared["model"])
    else:
        # Tensor parallel: loading initializes the optimizer's state with one step over
        # DTensor shards and whole parameters side by side.
        with getattr(parallel, "mixed_tensors", contextlib.nullcontext)():
            load_model_optimizer_state(
                model, optimizer, ckpt.shared["model"], ckpt.shared["optimizer"]
            )
    components.load_state_dict(saved)
