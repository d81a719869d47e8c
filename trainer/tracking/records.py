"""Turning step results into records: `metrics.jsonl`, the console, and the trackers.

Step results stay on the device between records; `.item()` happens here, once per record.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

import torch

from engine.distributed import DistInfo, all_reduce_sum
from engine.step import StepResult
from engine.timing import PhaseClock, PhaseTimes
from trainer.tracking.phases import PhaseTable

# A mixture of experts' record of the most-loaded expert's share over the mean (worst layer).
MOE_LOAD = "train/moe_load_max"


@runtime_checkable
class NamesItems(Protocol):
    """A task that names its loss items (`unit = "tokens"`, `"pairs"`, `"samples"`)."""

    unit: str


def item_unit(task: object) -> str:
    """What `task`'s loss items are: its `unit`, or `items` when it names none."""
    return task.unit if isinstance(task, NamesItems) and isinstance(task.unit, str) else "items"


def throughput_key(unit: str) -> str:
    """The record key of the loss items per second: `train/tokens_per_s` for a task of tokens
    (the name CONTRACT.md fixes), else by the task's unit (`train/pairs_per_s`)."""
    return f"train/{unit}_per_s"


def is_throughput(key: str) -> bool:
    """`train/<unit>_per_s`: a record's loss items per second, whatever the task's unit."""
    return key.startswith("train/") and key.endswith("_per_s") and key.count("/") == 1


class RecordSink:
    """Where rank 0's records go: a file, the console, a tracker."""

    def write(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """At the end of the run (also after an error)."""

    def closing_note(self) -> str | None:
        """One line for the end-of-run summary (None: nothing to say)."""
        return None


def strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with every non-finite float (NaN, ±inf: not JSON) as `null`, and a
    `non_finite` list naming those keys, so a strict parser reads every line."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: None if k in bad else v for k, v in record.items()}, "non_finite": bad}


class JsonlWriter(RecordSink):
    """Appends one strict-JSON object per line and flushes it, so a crash loses at most one
    line. Python's float repr round-trips exactly, so values are written at full precision.
    """

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def supersede(path: Path, step: int) -> int | None:
    """On resume from `step`: move the records of later steps (written before the run
    stopped, and about to be written again) from `path` to `*.superseded.jsonl` next to it, so
    `path` holds one record per step and kind; nothing is lost. Returns the newest step moved,
    or None when there was none."""
    if not path.exists():
        return None
    keep, moved, newest = [], [], None
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            later = int(json.loads(line)["step"]) > step
        except (ValueError, KeyError, TypeError):  # a line cut short by a crash
            later = not line.endswith("\n")
        if later:
            moved.append(line if line.endswith("\n") else line + "\n")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                newest = max(newest or 0, int(json.loads(line)["step"]))
        else:
            keep.append(line)
    if not moved:
        return None
    with path.with_name(path.stem + ".superseded.jsonl").open("a", encoding="utf-8") as f:
        f.writelines(moved)
        f.flush()
        os.fsync(f.fileno())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)  # the superseded copy is on disk first: a crash here loses nothing
    return newest


def _printable(text: str) -> str:
    """A sample as a terminal may show it: control characters an untrained model writes (a
    byte-level tokenizer's \\x03, an escape) are spelled out, never sent to the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


class Progress(RecordSink):
    """A live one-line bar on a terminal; plain periodic lines otherwise (logs, CI)."""

    def __init__(self, max_steps: int, stream: TextIO | None = None, unit: str = "tokens") -> None:
        self.max_steps = max_steps
        # Loss items per second, in the task's own unit (`unit = "tokens"` on the task).
        self.rate = "tok/s" if unit == "tokens" else f"{unit}/s"
        self.rate_key = throughput_key(unit)
        self.stream = stream or sys.stdout  # the stdout of now, not of when this was imported
        self.live = self.stream.isatty()
        self.start = time.perf_counter()
        self.start_step: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if "train/loss" not in record:
            sample = record.get("val/sample")
            record = {k: v for k, v in record.items() if k != "val/sample"}
            if sample:
                self._line(f"--- sample at step {step} ---\n{_printable(sample)}\n---")
            self._line(
                f"step {step:>6} | "
                + " ".join(f"{k} {_fmt(v)}" for k, v in record.items() if k != "step")
            )
            return
        if self.start_step is None:
            self.start_step, self.start = step, time.perf_counter()
        elapsed = time.perf_counter() - self.start
        done = step - self.start_step
        eta = elapsed / done * (self.max_steps - step) if done else float("nan")
        frac = step / self.max_steps
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        # A record of profiled steps only has no throughput (trainer/tracking/profiler.py).
        rate = record.get(self.rate_key)
        speed = f"{rate:,.0f} {self.rate}" if rate is not None else "profiled"
        text = (
            f"[{bar}] {step}/{self.max_steps} | loss {record['train/loss']:.4f} | "
            f"lr {record['train/lr']:.2e} | {speed} | "
            + (f"eps {record['train/epsilon']:.3g} | " if "train/epsilon" in record else "")
            # A mixture of experts' expert load (1 = balanced).
            + (f"expert load {load:.2f}x | " if (load := record.get(MOE_LOAD)) is not None else "")
            + f"eta {_duration(eta)}"
        )
        if self.live:
            self.stream.write("\r" + text.ljust(100))
            self.stream.flush()
            if step >= self.max_steps:
                self.stream.write("\n")
        else:
            self._line(text)

    def _line(self, text: str) -> None:
        if self.live:
            self.stream.write("\r" + " " * 100 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()


class EvalProgress:
    """Lines while an evaluation runs (rank 0): batches done, items/s, ETA. Every `every_s`
    seconds, and with `marks` at each tenth of the batches too (a whole split evaluated by
    `trainer.evaluate`): never minutes of silence, never a line per batch."""

    def __init__(
        self,
        total: int,
        label: str,
        every_s: float = 10.0,
        marks: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        self.total, self.label, self.every_s, self.marks = total, label, every_s, marks
        self.stream = stream or sys.stdout
        self.start = self.last = time.perf_counter()
        self.mark = 0

    def __call__(self, batches: int, items: torch.Tensor) -> None:
        now = time.perf_counter()
        mark = 10 * batches // max(self.total, 1)
        if not (self.marks and mark > self.mark) and now - self.last < self.every_s:
            return
        self.mark, self.last = mark, now
        n, elapsed = int(items.item()), max(now - self.start, 1e-9)
        eta = elapsed / batches * (self.total - batches)
        print(
            f"{self.label}: batch {batches}/{self.total} | {n:,} items ({n / elapsed:,.0f}/s) | "
            f"ETA {_duration(eta)}",
            file=self.stream,
            flush=True,
        )


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# Dense bf16 peak FLOP/s by device name, for MFU (as nanoGPT and torchtitan report it).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA allocator memory, or on CPU the process's peak resident set (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class TrainMeter:
    """Accumulates step results on the device and makes a training record when asked.

    Args:
        dist: where this rank runs.
        flops_per_token: model FLOPs per trained token (forward + backward), for MFU on GPUs.
        run_dir: where the per-rank phase table goes (trainer/tracking/phases.py).
        unit: what the task's loss items are (`item_unit`): names the throughput's key
            (`throughput_key`); MFU only for tokens, what `flops_per_token` counts.
    """

    def __init__(
        self,
        dist: DistInfo,
        flops_per_token: float | None = None,
        run_dir: Path | None = None,
        unit: str = "tokens",
    ) -> None:
        self.dist = dist
        self.flops_per_token = flops_per_token if unit == "tokens" else None
        self.rate_key = throughput_key(unit)
        self.peak_flops = device_peak_flops(dist.device)
        self.skipped = torch.zeros((), device=dist.device)
        self.consecutive_skips = torch.zeros((), device=dist.device)
        self.window_items = torch.zeros((), dtype=torch.int64, device=dist.device)
        self.window_steps = 0
        self.profiled_steps = 0  # steps under the profiler since the last record
        self.excluded_s = 0.0  # their time (and the profiler's own), out of the throughput
        self.last_time = time.perf_counter()
        self.phases = PhaseTable(dist, run_dir)

    def update(self, result: StepResult, profiled_s: float | None = None) -> None:
        """Count a step's result; `profiled_s`: the step ran under the profiler and took that
        long, so neither its items nor its time count towards throughput and MFU."""
        self.skipped += result.skipped
        self.consecutive_skips = (self.consecutive_skips + result.skipped) * result.skipped
        if profiled_s is not None:
            self.profiled_steps += 1
            self.exclude(profiled_s)
            return
        self.window_items += result.global_count
        self.window_steps += 1

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` spent since the last record (profiling) out of the throughput."""
        self.excluded_s += seconds

    def record(
        self,
        step: int,
        result: StepResult,
        extra: dict[str, Any],
        clock: PhaseClock | None = None,
    ) -> dict[str, Any]:
        """The record for `step` (1-based), whose result is `result`. Syncs with the device.
        With `clock`, every rank's phase times ride in the loss all-reduce (collective)."""
        loss_sum, per_rank = self._reduce(result.loss_sum, clock)
        count = result.global_count.item()
        items = self.window_items.item()
        now = time.perf_counter()  # after the syncs above: the device has finished the steps
        elapsed = max(now - self.last_time - self.excluded_s, 1e-9)
        record: dict[str, Any] = {
            "step": step,
            "train/loss": loss_sum / max(1, count),
            "train/grad_norm": result.grad_norm.item(),
            "train/lr": result.lr,
        }
        if self.window_steps:  # not only profiled steps since the last record
            record[self.rate_key] = items / elapsed
            record["train/step_time_ms"] = 1000 * elapsed / self.window_steps
        record["train/skipped_steps"] = int(self.skipped.item())
        record["train/peak_mem_mb"] = peak_memory_mb(self.dist.device)
        if self.flops_per_token and self.peak_flops and self.window_steps:
            rank_tokens_per_s = items / elapsed / self.dist.world_size
            record["train/mfu"] = self.flops_per_token * rank_tokens_per_s / self.peak_flops
        if self.profiled_steps:
            record["time/profiled"] = True  # flagged: some steps ran under the profiler
        if per_rank is not None:
            record.update(self.phases.record(per_rank))
        record.update(extra)
        self.restart_clock()
        return record

    def close_phases(self, clock: PhaseClock) -> dict[str, Any]:
        """Collective, at the end of the run: every rank's phase times since the last record
        (the final evaluation and checkpoint) into the phase table (`PhaseTable.close`).
        Returns the slowest rank's seconds per phase that had any, on rank 0 ({} elsewhere,
        and with phase timing off)."""
        if not clock.enabled:
            return {}
        _, per_rank = self._reduce(torch.zeros((), device=self.dist.device), clock)
        return self.phases.close(per_rank) if per_rank is not None else {}

    def _reduce(
        self, loss_sum: torch.Tensor, clock: PhaseClock | None
    ) -> tuple[float, list[list[float]] | None]:
        """The loss summed over ranks and, with phase timing, every rank's `PhaseTimes`: one
        all-reduce of [loss, rank 0's times, rank 1's times, ...], each rank filling its own
        slot (the loss keeps its dtype, so its sum is the same as alone)."""
        times = clock.collect() if clock is not None else None
        if times is None:
            return all_reduce_sum(loss_sum, self.dist).item(), None
        self.phases.gather_hosts()
        width, rank, world = PhaseTimes.width(), self.dist.rank, self.dist.world_size
        dtype = torch.promote_types(loss_sum.dtype, torch.float32)
        packed = torch.zeros(1 + world * width, dtype=dtype)
        packed[1 + rank * width : 1 + (rank + 1) * width] = torch.tensor(times.as_list())
        packed = packed.to(self.dist.device)
        packed[0] = loss_sum
        values = all_reduce_sum(packed, self.dist).tolist()
        return values[0], [values[1 + r * width : 1 + (r + 1) * width] for r in range(world)]

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped.cpu(), "consecutive_skips": self.consecutive_skips.cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped.copy_(state["skipped"])
        self.consecutive_skips.copy_(state["consecutive_skips"])

    def restart_clock(self) -> None:
        """Exclude time spent outside training steps (evaluation, checkpoints) from tokens/s."""
        self.window_items.zero_()
        self.window_steps = self.profiled_steps = 0
        self.excluded_s = 0.0
        self.last_time = time.perf_counter()
