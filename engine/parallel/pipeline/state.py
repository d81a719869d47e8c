"""Whole-model checkpoint state across pipeline stages: the optimizer's state keyed by
parameter name, and the stages' states merged into one."""

from __future__ import annotations

from typing import Any

import torch

from engine.parallel.base import whole_tensor


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    return whole_tensor(t).detach().cpu().clone()


def laid_out_like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `ref`: sharded the same way when `ref` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(ref, DTensor):
        return distribute_tensor(full.to(ref.device, ref.dtype), ref.device_mesh, ref.placements)
    return full


def named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> dict[str, Any]:
    """`optimizer.state_dict()` keyed by parameter name (the format of a `full` checkpoint),
    on the CPU."""
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    sd = optimizer.state_dict()
    state = {
        order[i]: {k: (on_cpu(v) if torch.is_tensor(v) else v) for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str], saved: dict[str, Any]
) -> None:
    """Load a name-keyed optimizer state (any pipeline split, or none) into `optimizer`."""
    group_of = {n: g for g in saved["param_groups"] for n in g["params"]}
    state, groups, index = {}, [], 0
    for g in optimizer.param_groups:
        ids = []
        for p in g["params"]:
            name = names[id(p)]
            if name not in group_of:
                raise KeyError(f"the checkpoint's optimizer has no state for {name}")
            if name in saved["state"]:  # moments shaped like the parameter: sharded like it
                state[index] = {
                    k: laid_out_like(v, p) if torch.is_tensor(v) and v.shape == p.shape else v
                    for k, v in saved["state"][name].items()
                }
            ids.append(index)
            index += 1
        first = names[id(g["params"][0])] if g["params"] else None
        hyper = {k: v for k, v in (group_of[first] if first else g).items() if k != "params"}
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def merge_states(
    parts: list[tuple[dict[str, Any], dict[str, Any]]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One whole-model state from the stages' name-keyed ones (a name on several stages, a
    tied parameter, holds the same value on each)."""
    model_state: dict[str, Any] = {}
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for m, o in parts:
        for k, v in m.items():
            model_state.setdefault(k, v)
        for k, v in o["state"].items():
            state.setdefault(k, v)
        for g in o["param_groups"]:
            hyper = {k: v for k, v in g.items() if k != "params"}
            same = next((h for h in groups if _same_hyper(h, hyper)), None)
            if same is None:
                same = {**hyper, "params": []}
                groups.append(same)
            same["params"] += [n for n in g["params"] if n not in same["params"]]
    return model_state, {"state": state, "param_groups": groups}


def _same_hyper(group: dict[str, Any], hyper: dict[str, Any]) -> bool:
    return {k: v for k, v in group.items() if k != "params"} == hyper
