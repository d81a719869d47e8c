"""The planner's progress: a line every `EVERY` seconds while it works, saying what it
simulates (which layout, role and step) and where the simulated step is (forward or
backward, the innermost module running), so a minutes-long plan is never silent."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

EVERY = 5.0  # seconds between lines (a quick plan prints none)


class Progress:
    """Written to by the planner (`what`, `peaks`), read by a timer thread that prints."""

    def __init__(self, every: float | None = None, out: TextIO | None = None) -> None:
        self.every = EVERY if every is None else every
        self.out = out
        self.what = "starting"
        self.prefix = ""  # the search's layout, when it simulates one
        self.peaks: Any = None  # the StepPeaks of the step being simulated
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.every == float("inf"):
            return self
        self._thread = threading.Thread(target=self._run, name="plan-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            print(self.line(), file=self.out or sys.stdout, flush=True)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        return f"plan: {elapsed:4.0f} s  {self.prefix}{self.what}{self.where()}"

    def where(self) -> str:
        """`, forward model.layers.5.mlp`: the simulated step's innermost running module."""
        tracker = getattr(self.peaks, "tracker", None)
        modules = getattr(tracker, "_mod_tracker", None)
        if modules is None:
            return ""
        for _ in range(3):  # the set changes under the simulation's thread: copy it whole
            try:
                names = [n for n in list(modules.parents) if n != "Global"]
                break
            except RuntimeError:
                continue
        else:
            return ""
        if not names:
            return ""
        phase = "backward" if modules.is_bw else "forward"
        return f", {phase} {max(names, key=lambda n: (n.count('.'), len(n)))}"


def quiet() -> Progress:
    """A Progress that prints nothing (a planner called as a library)."""
    return Progress(every=float("inf"))
