"""One measure of a training step's memory, for the planner's simulated ranks and a real run's
first steps alike (`train.memory_report=true`): the same tracker on fake or real tensors.

torch's `MemTracker` (`torch.distributed._tools.mem_tracker`, tested by torch within 10% of
the CUDA allocator's peak) sees every tensor allocated through the dispatcher and sorts it
into parameters, gradients, optimizer state, activations (kept for backward), temporaries
and buffers; the breakdown at the moment of the peak is reported. Parameter, gradient and
optimizer bytes are also counted directly from this rank's own tensors after the steps (its
shards under FSDP, its stages under a pipeline): exact, and the same in a plan and a run.
What the layout allocates outside the dispatcher (DDP's gradient buckets) is added apart.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModMemStats

from engine.parallel.base import Parallelism, local_values
from engine.preference import DPOTask

_BLOCK = re.compile(r"\.\d+$")  # a module name ending in a list index: one of the blocks
# A fake tensor's device, asked through every dispatch mode (about 60% of the dispatched ops
# of a mixture's simulated experts): answered below, by the fake mode.
DEVICE_QUERY = torch.ops.prim.device.default


class _NoHook:
    def remove(self) -> None:
        pass


class StepTracker(MemTracker):
    """`MemTracker` over any number of forwards per step (micro-batches, pipeline stages):
    a root module's next forward starts its module statistics afresh (MemTracker refuses a
    second root forward otherwise); the device-level peak runs on across them. Frozen
    parameters (a base under adapters) get no gradient hook: torch cannot hook them, and they
    have no gradient to see.

    With `blocks` (the planner's samples: the blocks of each stage), also the memory after
    every op, keyed by its *moment* (`Moments`), which is the same op of the same step for
    any number of blocks: each moment's bytes are a linear function of the blocks, which
    the planner's extrapolation uses (trainer/planning/extrapolate.py)."""

    def __init__(self, blocks: int | None = None) -> None:
        super().__init__()
        self.moments = Moments(blocks) if blocks else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is DEVICE_QUERY:  # allocates nothing: not a moment of the step
            return func(*args)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        for p in module.parameters():
            if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        again = module in self.memory_tracking and not self._mod_tracker.is_bw
        if again and set(self._mod_tracker.parents) - {name} == {"Global"}:
            self.reset_mod_stats()  # nothing runs inside a root module here: nothing lost
        super()._pre_fw_hook(module, inputs)

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        self._known(module)
        super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        self._known(module)
        super()._post_bw_hook(module, args)

    def _known(self, module: nn.Module | None) -> None:
        """A module whose statistics a later root forward reset before its backward: the
        same model run again between a forward and its backward (task.reference=adapter
        scores with the policy's base, its adapters off, whose modules then miss: a KeyError in
        MemTracker's backward hooks). The device-level figures need none of its statistics."""
        if module is not None and module not in self.memory_tracking:
            name = self._mod_tracker.get_known_fqn(module) or type(module).__name__
            self.memory_tracking[module] = _ModMemStats(name)

    def _update_peak_stats(self, peak_state: Any) -> None:
        """The device-level peak only, after every op. MemTracker also walks every module it
        has seen to update that module's own peak (a weak-reference lookup per module per
        op): ~40% of a Llama-3-8B stage's simulated step, for statistics no report reads."""
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)
        if self.moments is not None:
            phase = "opt" if self._in_opt else "bw" if self._mod_tracker.is_bw else "fw"
            self.moments.record(phase, self._mod_tracker.parents, self._curr_mem_snap)


class Moments:
    """The memory after every op of a step, keyed so that the key names the same op for a
    stage of any number of blocks (>= 2): the phase (`fw`, `bw`, `opt`), the segment it
    runs in (inside the stage's first block, its last, a middle one, or outside blocks
    after one of those), the how-many-th such segment of the phase, and the op's index in
    it. Middle blocks are no sample's in common; every other key is."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.at: dict[str, dict[str, int]] = {}
        self._segment: tuple[str, str | None] = ("", None)
        self._after = "start"  # the last block class run in this phase
        self._seen: dict[tuple[str, str], int] = {}
        self._op = 0

    def _kind(self, block: str) -> str:
        index = int(block.rsplit(".", 1)[1])
        return "first" if index == 0 else "last" if index == self.blocks - 1 else "middle"

    def record(self, phase: str, parents: Any, snap: dict[Any, dict[Any, int]]) -> None:
        blocks = [n for n in parents if _BLOCK.search(n)]
        block = None
        if blocks:  # the outermost; in backward a block's exit can come late: the newest
            short = min(len(n) for n in blocks)
            outer = [n for n in blocks if len(n) == short]
            index = min if phase == "bw" else max
            block = index(outer, key=lambda n: int(n.rsplit(".", 1)[1]))
        segment = (phase, block)
        if segment != self._segment:
            if phase != self._segment[0]:
                self._after = "start"
            kind = self._kind(block) if block else f"after-{self._after}"
            if block:
                self._after = kind
            count = self._seen.get((phase, kind), 0) + 1
            self._seen[phase, kind] = count
            self._segment, self._name, self._op = segment, f"{phase}/{kind}/{count}", 0
        else:
            self._op += 1
        if "middle" in self._name:
            return
        summed: dict[str, int] = {}
        for device in snap.values():
            for kind, value in device.items():
                key = str(kind).rsplit(".", 1)[-1]
                summed[key] = summed.get(key, 0) + value
        self.at[f"{self._name}/{self._op}"] = summed


@dataclass
class MemoryReport:
    """One rank's memory over its measured steps, in bytes."""

    peak_bytes: int  # tracked peak plus untracked (DDP's buckets)
    parameters_bytes: int  # this rank's own parameter storage
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # at the peak: tensors kept for backward
    temporaries_bytes: int  # at the peak: everything else allocated in the step
    buffers_bytes: int
    # A frozen module the task scores with (task.reference=copy): this rank's parameters and
    # buffers of it, in the peak (the tracker's PARAM and BUFFER) and apart from the above.
    reference_bytes: int = 0
    untracked: dict[str, int] = field(default_factory=dict)
    at_peak: dict[str, int] = field(default_factory=dict)  # the tracker's categories there
    # The categories at the highest point of each moment (StepTracker.moment): the planner's.
    moments: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Every field but `moments` (one entry per op of the step: a deep copy of them took
        7% of a 30B mixture's plan)."""
        fields = {k: v for k, v in vars(self).items() if k != "moments"}
        return {k: dict(v) if isinstance(v, dict) else v for k, v in fields.items()}


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's values of `tensors` (a DTensor's local shard), each tensor once."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = local_values(t)
        seen[id(t)] = local.numel() * local.element_size()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def frozen_modules(task: object) -> list[nn.Module]:
    """The modules a task runs in the step besides the model, frozen: task.reference=copy's
    copy of the initial policy (its weights are memory the model's parameters do not count;
    `adapter` scores with the policy's own base, `precomputed` and `none` with no model)."""
    if isinstance(task, DPOTask) and task.frozen_copy is not None:
        return [task.frozen_copy.module]
    return []


class StepPeaks:
    """The tracked peak over steps, each step tracked on its own (the loop's work between
    steps, a loader materializing data, is not the step's memory): the breakdown of the step
    whose peak was highest."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self.moments: dict[str, dict[str, int]] = {}  # each step's moments (StepTracker)
        self.blocks: int | None = None  # blocks per stage, when moments are wanted
        self.tracker: StepTracker | None = None  # the step's, while it runs (for progress)
        self.steps = 0

    @contextlib.contextmanager
    def step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, frozen: Iterable[nn.Module] = ()
    ) -> Iterator[None]:
        """Tracks one step of `model` and `optimizer`; `frozen`: modules the step runs besides
        the model (`frozen_modules`), whose weights count among the parameters at the peak."""
        tracker = StepTracker(self.blocks)
        self.steps += 1
        tracker.track_external(model, optimizer, *frozen)
        self.tracker = tracker
        try:
            with tracker:
                yield
        finally:
            self.tracker = None
        peak: dict[str, int] = {}
        for snap in tracker.get_tracker_snapshot("peak").values():
            peak = _named(snap, peak)
        if peak.get("Total", 0) >= self.peak.get("Total", 0):
            self.peak = peak
        if tracker.moments is not None:
            for moment, named in tracker.moments.at.items():
                self.moments[f"step {self.steps}/{moment}"] = named


def _named(snap: dict[Any, int], into: dict[str, int]) -> dict[str, int]:
    """A tracker snapshot keyed by category names (`ACT`, `TEMP`, ..., `Total`), added to
    `into`."""
    for kind, value in snap.items():
        key = str(kind).rsplit(".", 1)[-1]
        into[key] = into.get(key, 0) + int(value)
    return into


def report(
    peaks: StepPeaks,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    parallel: Parallelism,
    frozen: Iterable[nn.Module] = (),
) -> MemoryReport:
    """The breakdown at the tracked peak, with this rank's exact own bytes (and those of the
    `frozen` modules the step ran, `reference_bytes`)."""
    frozen = list(frozen)
    peak = peaks.peak
    untracked = parallel.untracked_bytes(model)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return MemoryReport(
        peak_bytes=peak.get("Total", 0) + sum(untracked.values()),
        parameters_bytes=local_bytes(model.parameters()),
        gradients_bytes=local_bytes(grads),
        optimizer_bytes=local_bytes(optimizer_tensors(optimizer)),
        activations_bytes=peak.get("ACT", 0),
        temporaries_bytes=peak.get("TEMP", 0),
        buffers_bytes=local_bytes(model.buffers()),
        reference_bytes=local_bytes(t for m in frozen for t in (*m.parameters(), *m.buffers())),
        untracked=untracked,
        at_peak=dict(peak),
        moments={k: dict(v) for k, v in peaks.moments.items()},
    )


class MemoryWindow:
    """`train.memory_report=true`: the fit loop's step function, measured over the run's first
    `steps` steps, or the steps there are when the run ends sooner (`train.max_steps=1`, a
    resumed run's last step); then every rank's report goes to rank 0, which writes
    memory_report.json."""

    def __init__(self, inner: Any, steps: int, path: Path) -> None:
        self.inner, self.steps, self.path = inner, steps, path
        self.peaks = StepPeaks()
        self.done = 0
        self.first: int | None = None  # the first step measured

    def __call__(self, run: Any, window: Any, windows: Any) -> tuple[Any, Any]:
        if self.done >= self.steps:
            return self.inner(run, window, windows)
        if self.first is None:
            self.first = run.step + 1
        with self.peaks.step(run.ctx.model, run.ctx.optimizer, frozen_modules(run.ctx.task)):
            out = self.inner(run, window, windows)
        self.done += 1
        if self.done == self.steps or run.step >= run.settings.train.max_steps:
            self._write(run)
            self.done = self.steps  # measured: the rest of the run is not
        return out

    def _write(self, run: Any) -> None:
        from engine.distributed import gather_object

        ctx = run.ctx
        frozen = frozen_modules(ctx.task)
        mine = report(self.peaks, run.state.model, ctx.optimizer, ctx.parallel, frozen)
        everyone = gather_object({"rank": run.dist.rank, **mine.as_dict()}, run.dist)
        if everyone is not None:
            self.path.write_text(json.dumps({"steps": self.done, "ranks": everyone}, indent=1))
            top = max(everyone, key=lambda r: r["peak_bytes"])
            kinds = ("parameters", "gradients", "optimizer", "activations")
            parts = ", ".join(f"{k} {top[f'{k}_bytes'] / 2**20:.1f}" for k in kinds)
            steps = f"step {run.step}" if self.done == 1 else f"steps {self.first}-{run.step}"
            short = (
                f" (the run has {self.done} step{'s' if self.done > 1 else ''} to measure of the "
                f"{self.steps} a report measures: the optimizer's state is created in the first)"
                if self.done < self.steps
                else ""
            )
            print(
                f"memory report of {steps}{short}: peak {top['peak_bytes'] / 2**20:.1f} MiB "
                f"on rank {top['rank']} ({parts} MiB), written to {self.path}",
                flush=True,
            )
