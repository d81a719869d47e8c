"""A user's component that fails inside its own code keeps its traceback, headed by one line
naming the component, the step and the user's frame (`trainer.config.cli` prints it)."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

# Function names that say which component a frame of the user's code belongs to.
ROLES = {
    "forward": "model",
    "loss_sum": "task",
    "count_items": "task",
    "eval_sums": "task",
    "__getitem__": "data",
    "__getitems__": "data",
}


def annotate(exc: BaseException, head: str) -> BaseException:
    """`exc` unchanged (its traceback kept), with the one line `trainer.config.cli` prints above the
    traceback: which component failed, at which step, and where in the user's own code."""
    frame = user_frame(exc)
    exc.cumulus_context = head + (f" ({frame})" if frame else "") + ":"  # type: ignore[attr-defined]
    return exc


OURS = tuple(str(Path(__file__).resolve().parents[2] / d) for d in ("engine", "trainer"))


def user_frame(exc: BaseException) -> str | None:
    """`file:line in function` of the innermost frame of the user's code (not torch's, not a
    library's, not cumulus's), or None."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if _is_user(frame.filename):
            found = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    return found


def _is_user(path: str) -> bool:
    return not (
        "site-packages" in path
        or "/lib/python" in path
        or path.startswith(OURS)
        or path.startswith("<")
    )


def annotate_step(exc: BaseException, nodes: dict[str, Any], step: int) -> BaseException:
    """Head a failure of the user's code during optimizer step `step` with the component it
    was in (`model` / `task` / `data`, with its `_target_`); cumulus's own failures and
    library errors without a user frame are left alone."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user(f.filename)]
    if not frames:
        return exc
    role = next((ROLES[f.name] for f in reversed(frames) if f.name in ROLES), None)
    if role is None and any(f.name.startswith("on_") for f in frames):
        role = "callbacks"  # engine/callbacks/'s hooks: on_after_backward, ...
    target = nodes.get(role, {}).get("_target_") if role else None
    what = f"`{role}` ({target})" if target else "a callback" if role else "your code"
    return annotate(exc, f"error in {what} during step {step}")
