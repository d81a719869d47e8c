"""Turning step results into records: `metrics.jsonl`, the console, and W&B.

Step results stay on the device between records; `.item()` happens here, once per record.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

from engine.distributed import DistInfo, all_reduce_sum
from engine.step import StepResult


class RecordSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most one line.

    Python's float repr round-trips exactly, so values are written at full precision.
    """

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class Progress:
    """A live one-line bar on a terminal; plain periodic lines otherwise (logs, CI)."""

    def __init__(self, max_steps: int, stream: TextIO = sys.stdout) -> None:
        self.max_steps = max_steps
        self.stream = stream
        self.live = stream.isatty()
        self.start = time.perf_counter()
        self.start_step: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if "train/loss" not in record:
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
        text = (
            f"[{bar}] {step}/{self.max_steps} | loss {record['train/loss']:.4f} | "
            f"lr {record['train/lr']:.2e} | {record['train/tokens_per_s']:,.0f} tok/s | "
            f"eta {_duration(eta)}"
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

    def close(self) -> None:
        pass


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class TrainMeter:
    """Accumulates step results on the device and makes a training record when asked."""

    def __init__(self, dist: DistInfo) -> None:
        self.dist = dist
        self.skipped = torch.zeros((), device=dist.device)
        self.consecutive_skips = torch.zeros((), device=dist.device)
        self.window_items = torch.zeros((), dtype=torch.int64, device=dist.device)
        self.last_time = time.perf_counter()

    def update(self, result: StepResult) -> None:
        self.skipped += result.skipped
        self.consecutive_skips = (self.consecutive_skips + result.skipped) * result.skipped
        self.window_items += result.global_count

    def record(self, step: int, result: StepResult, extra: dict[str, Any]) -> dict[str, Any]:
        """The record for `step` (1-based), whose result is `result`. Syncs with the device."""
        loss_sum = all_reduce_sum(result.loss_sum, self.dist)
        now = time.perf_counter()
        record = {
            "step": step,
            "train/loss": loss_sum.item() / max(1, result.global_count.item()),
            "train/grad_norm": result.grad_norm.item(),
            "train/lr": result.lr,
            "train/tokens_per_s": self.window_items.item() / max(now - self.last_time, 1e-9),
            "train/skipped_steps": int(self.skipped.item()),
            **extra,
        }
        self.window_items.zero_()
        self.last_time = now
        return record

    def restart_clock(self) -> None:
        """Exclude time spent outside training steps (evaluation, checkpoints) from tokens/s."""
        self.window_items.zero_()
        self.last_time = time.perf_counter()
