"""Where a step's time goes on this rank: data wait, compute, waiting inside collectives,
the optimizer (and checkpoints and evaluation when they happen).

`PhaseClock` splits the rank's time into exclusive phases by `switch`ing from one to the next
at the moments the step already passes through. It costs one clock read per switch and no
device synchronization: on a CPU the host clock *is* the work's clock; on CUDA each switch
records an event on the current stream (a few microseconds, asynchronous), and the events are
read only when a record is written (`collect`), where the step's results are read anyway.

Waiting inside a collective is its own phase (`sync`), because an all-reduce hides a compute
straggler: the slow rank's forward and backward look as long as everybody else's once the fast
ranks' wait for it is counted as theirs. The step's own collectives are wrapped in
`collective(...)`; the gradient all-reduce that DDP runs inside the last micro-batch's backward
is measured by `wait_after_backward`: a callback queued on autograd's engine runs when the
graph has computed every gradient and before DDP's (or FSDP's) own final callback waits for
the reduction, so the rest of `backward()` is the wait.

The clock also says where the rank is (`phase`, `seq`: collectives entered, `waiting_in`) for
the watch that names a hung rank, and, while a profiler records, opens `record_function` spans
for the step, each phase and each micro-batch (`trace`, `span`).

`CUMULUS_PHASE_TIMING=0` turns the timing off (the benchmark's baseline): positions are still
kept, nothing is measured.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

# Phases of a training step, then the occasional ones (reported as totals when they happen).
STEP_PHASES = ("data", "generate", "compute", "sync", "optimizer")
# Step phases only some runs have (task=grpo's rollouts): recorded when a rank spent time there.
WHEN_USED = ("generate",)
PHASES = (*STEP_PHASES, "checkpoint", "eval")
_INDEX = {name: i for i, name in enumerate(PHASES)}
# CUDA: completed events are folded into the totals once this many are pending.
_FOLD_AT = 512


def timing_enabled() -> bool:
    """Phase timing is always on unless `CUMULUS_PHASE_TIMING=0` (benchmarks only)."""
    return os.environ.get("CUMULUS_PHASE_TIMING", "1") != "0"


class PhaseTimes:
    """Seconds per phase (`PHASES` order) over `steps` optimizer steps of one rank."""

    def __init__(self, seconds: list[float], steps: int) -> None:
        self.seconds, self.steps = seconds, steps

    def as_list(self) -> list[float]:
        return [*self.seconds, float(self.steps)]

    @staticmethod
    def width() -> int:
        """Values per rank in `as_list` (the phases, then the step count)."""
        return len(PHASES) + 1


class PhaseClock:
    """Exclusive phase timing of this rank (see the module docstring).

    Args:
        device: the device the step runs on; CUDA events time a CUDA device.
        enabled: measure (default: unless `CUMULUS_PHASE_TIMING=0`).
    """

    def __init__(self, device: torch.device | None = None, enabled: bool | None = None) -> None:
        self.enabled = timing_enabled() if enabled is None else enabled
        self.cuda = device is not None and device.type == "cuda"
        self.phase: str | None = None  # the phase now (None: outside every phase)
        self._index: int | None = None
        self._since = time.perf_counter()
        self._seconds = [0.0] * len(PHASES)
        self._marks: list[tuple[int | None, Any]] = []  # CUDA: (phase ending here, event)
        self._spare: list[Any] = []  # CUDA events to reuse
        self.steps = 0  # steps begun since the last `collect`
        # Where this rank is, for the hang watch (trainer/run/hang.py); plain attributes that
        # another thread reads.
        self.step = 0  # the optimizer step being taken (or the last one taken)
        self.seq = 0  # collectives entered through this clock
        self.waiting_in: str | None = None  # the collective waited in now
        self.failed_in: str | None = None  # the collective that raised, this step
        self.moves = 0  # switches so far: the rank is moving while this grows
        # Profiler spans (only while a profiler records).
        self._tracing = False
        self._owner: int | None = None
        self._step_span: Any = None
        self._phase_span: Any = None

    # ---- phases ----
    def switch(self, phase: str | None) -> str | None:
        """End the current phase and start `phase` (None: outside every phase, not counted);
        returns the phase that ended."""
        previous = self.phase
        self.phase, self.moves = phase, self.moves + 1
        if self.enabled:
            self._account(_INDEX.get(phase) if phase else None)
        if self._tracing and threading.get_ident() == self._owner:
            self._close_phase_span()
            self._open_phase_span()
        return previous

    @contextlib.contextmanager
    def within(self, phase: str) -> Iterator[None]:
        """`phase` for the duration of the block; the phase before resumes after it."""
        previous = self.switch(phase)
        try:
            yield
        finally:
            self.switch(previous)

    def begin_step(self, step: int) -> None:
        """Optimizer step `step` (1-based) starts: its data wait begins."""
        self.steps += 1
        self.step, self.failed_in = step, None
        if self._tracing:
            self._close_phase_span()
            self._close_step_span()
            self._step_span = _enter(f"step {step}")
        self.switch("data")

    def end_step(self) -> None:
        """The step's update is done: what follows (records, evaluation, checkpoints) is not
        part of the step's phases."""
        self.switch(None)
        if self._tracing:
            self._close_step_span()

    # ---- collectives ----
    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """Around a collective the step calls: its time is `sync`, and the rank is known to be
        inside collective `name` (the hang watch's position). A collective that raises (timed
        out) is kept as `failed_in` until the next step or collective: the hang watch, which
        reads the position after the exception unwound, then names `sync` and the collective,
        as the timers and the trace do, not the phase the collective was entered from."""
        previous = self.enter(name)
        try:
            yield
        except BaseException:
            self.failed_in = name
            raise
        finally:
            self.leave(previous)

    def enter(self, name: str) -> str | None:
        """This rank starts waiting in collective `name`; returns the phase it leaves."""
        self.seq += 1
        self.waiting_in, self.failed_in = name, None
        return self.switch("sync")

    def leave(self, phase: str | None) -> None:
        """The collective entered last has returned; `phase` resumes."""
        self.waiting_in = None
        self.switch(phase)

    def wait_after_backward(self, loss: torch.Tensor, name: str = "gradient sync") -> None:
        """Before `loss.backward()` of a micro-batch whose gradients are synchronized inside
        backward (DDP's bucketed all-reduce, FSDP's reduce-scatter): the part of backward
        after the last gradient is computed counts as `sync`. Call `after_backward` after."""
        if not loss.requires_grad:
            return
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

        def gradients_computed() -> None:
            self.enter(name)

        def queue(grad: torch.Tensor) -> None:
            # Runs first in backward (the loss is the graph's root), so this callback is queued
            # before the one DDP or FSDP queue later: it runs when every gradient is computed
            # and before their wait for the reduction.
            engine.queue_callback(gradients_computed)

        loss.register_hook(queue)

    def after_backward(self) -> None:
        """After the backward `wait_after_backward` prepared: compute resumes."""
        if self.waiting_in is not None:
            self.leave("compute")

    # ---- reading ----
    def collect(self) -> PhaseTimes | None:
        """Seconds per phase since the last call, and the steps begun (None when timing is
        off). On CUDA it waits for the last event: call it only when a record is written."""
        if not self.enabled:
            return None
        if self.cuda:
            self._fold(wait=True)
        else:
            self._account(self._index)  # the current phase's time so far
        times = PhaseTimes(self._seconds, self.steps)
        self._seconds, self.steps = [0.0] * len(PHASES), 0
        return times

    def _account(self, index: int | None) -> None:
        """The segment of the phase now ending is counted; phase `index` starts."""
        ending, self._index = self._index, index
        if self.cuda:
            self._mark(ending)
            return
        now = time.perf_counter()
        if ending is not None:
            self._seconds[ending] += now - self._since
        self._since = now

    def _mark(self, index: int | None) -> None:
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks.append((index, event))
        if len(self._marks) >= _FOLD_AT:
            self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        """Add the segments between completed events to the totals; keep the last event as
        the start of what follows."""
        marks = self._marks
        if len(marks) < 2:
            return
        if wait:
            marks[-1][1].synchronize()
            done = len(marks)
        else:
            done = 1
            while done < len(marks) and marks[done][1].query():
                done += 1
        for (_, start), (index, end) in itertools.pairwise(marks[:done]):
            if index is not None:
                self._seconds[index] += start.elapsed_time(end) / 1000.0
        self._spare.extend(event for _, event in marks[: done - 1])
        self._marks = marks[done - 1 :]

    # ---- profiler spans ----
    def trace(self, on: bool) -> None:
        """Open `record_function` spans for steps, phases and micro-batches (while a profiler
        records), or close them."""
        if on == self._tracing:
            return
        if on:
            self._tracing, self._owner = True, threading.get_ident()
            self._open_phase_span()
        else:
            self._close_phase_span()
            self._close_step_span()
            self._tracing = False

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """A profiler span `name` around the block (a micro-batch); nothing when not tracing.
        The phase spans inside it nest properly."""
        if not self._tracing:
            yield
            return
        self._close_phase_span()
        outer = _enter(name)
        self._open_phase_span()
        try:
            yield
        finally:
            self._close_phase_span()
            _exit(outer)
            self._open_phase_span()

    def _open_phase_span(self) -> None:
        if self.phase is not None:
            label = f"sync ({self.waiting_in})" if self.waiting_in else self.phase
            self._phase_span = _enter(label)

    def _close_phase_span(self) -> None:
        if self._phase_span is not None:
            _exit(self._phase_span)
            self._phase_span = None

    def _close_step_span(self) -> None:
        if self._step_span is not None:
            _exit(self._step_span)
            self._step_span = None


def _enter(name: str) -> Any:
    span = torch.autograd.profiler.record_function(name)
    span.__enter__()
    return span


def _exit(span: Any) -> None:
    span.__exit__(None, None, None)
