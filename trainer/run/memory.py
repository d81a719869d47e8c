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
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from engine.parallel.base import Parallelism, local_values


class _NoHook:
    def remove(self) -> None:
        pass


class StepTracker(MemTracker):
    """`MemTracker` over any number of forwards per step (micro-batches, pipeline stages):
    a root module's next forward starts its module statistics afresh (MemTracker refuses a
    second root forward otherwise); the device-level peak runs on across them. Frozen
    parameters (a base under adapters) get no gradient hook: torch cannot hook them, and they
    have no gradient to see."""

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
    untracked: dict[str, int] = field(default_factory=dict)
    at_peak: dict[str, int] = field(default_factory=dict)  # the tracker's categories there

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's values of `tensors` (a DTensor's local shard), each tensor once."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = local_values(t)
        seen[id(t)] = local.numel() * local.element_size()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


class StepPeaks:
    """The tracked peak over steps, each step tracked on its own (the loop's work between
    steps, a loader materializing data, is not the step's memory): the breakdown of the step
    whose peak was highest."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}

    @contextlib.contextmanager
    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        tracker = StepTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            yield
        peak: dict[str, int] = {}
        for snap in tracker.get_tracker_snapshot("peak").values():
            for kind, value in snap.items():
                key = str(kind).rsplit(".", 1)[-1]
                peak[key] = peak.get(key, 0) + int(value)
        if peak.get("Total", 0) >= self.peak.get("Total", 0):
            self.peak = peak


def report(
    peaks: StepPeaks,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    parallel: Parallelism,
) -> MemoryReport:
    """The breakdown at the tracked peak, with this rank's exact own bytes."""
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
        untracked=untracked,
        at_peak=dict(peak),
    )


class MemoryWindow:
    """`train.memory_report=true`: the fit loop's step function, measured over the run's first
    `steps` steps; then every rank's report goes to rank 0, which writes memory_report.json."""

    def __init__(self, inner: Any, steps: int, path: Path) -> None:
        self.inner, self.steps, self.path = inner, steps, path
        self.peaks = StepPeaks()
        self.done = 0

    def __call__(self, run: Any, window: Any, windows: Any) -> tuple[Any, Any]:
        if self.done >= self.steps:
            return self.inner(run, window, windows)
        with self.peaks.step(run.ctx.model, run.ctx.optimizer):
            out = self.inner(run, window, windows)
        self.done += 1
        if self.done == self.steps:
            self._write(run)
        return out

    def _write(self, run: Any) -> None:
        from engine.distributed import gather_object

        mine = report(self.peaks, run.state.model, run.ctx.optimizer, run.ctx.parallel)
        everyone = gather_object({"rank": run.dist.rank, **mine.as_dict()}, run.dist)
        if everyone is not None:
            self.path.write_text(json.dumps({"steps": self.steps, "ranks": everyone}, indent=1))
            top = max(everyone, key=lambda r: r["peak_bytes"])
            kinds = ("parameters", "gradients", "optimizer", "activations")
            parts = ", ".join(f"{k} {top[f'{k}_bytes'] / 2**20:.1f}" for k in kinds)
            print(
                f"memory report of steps 1-{self.steps}: peak {top['peak_bytes'] / 2**20:.1f} MiB "
                f"on rank {top['rank']} ({parts} MiB), written to {self.path}",
                flush=True,
            )
