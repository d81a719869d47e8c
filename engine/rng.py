"""Capture and restore every random generator a rank uses, as checkpoint-safe values.

`torch.load(weights_only=True)` refuses NumPy arrays, so NumPy's state is stored as plain
Python values (the `bit_generator.state` dict of the legacy global RandomState's MT19937
converted to a tensor).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_python_state(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(state["torch"])
    # A GPU checkpoint resumed without CUDA: there is no CUDA generator to restore.
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(s: Any) -> tuple:
    # random.getstate() is (version, tuple_of_ints, gauss_next); lists after a round trip.
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
