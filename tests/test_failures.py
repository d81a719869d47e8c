"""Failure paths of real clusters: a checkpoint write that fails (disk full, quota), a second
launch on a live run directory, and the run-directory lock that decides between them.

Write failures are made real with `RLIMIT_FSIZE` (tests/write_limit.py): from step 3 on, the
chosen rank's process cannot grow a file past 50 kB, so writing checkpoint 4 fails with EFBIG
inside `torch.save` or DCP, exactly as a full disk does. The rerun drops the limit (same
config) and must resume from checkpoint 2 on the uninterrupted trajectory, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import ranks
from tests.conftest import TINY, read_metrics
from tests.ranks import explain, launch, launch_all, torchrun_cmd
from trainer.run import lock as run_lock
from trainer.run.lock import LOCK_NAME, STALE_AFTER_S, RunDirInUse, RunLock

TIMEOUT = 240.0
LIMIT = "tests.write_limit.LimitFileSize"
BASE = [
    *TINY,
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    "train.max_steps=8",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=10",
    f"+callbacks.limit._target_={LIMIT}",
    "+callbacks.limit.after_step=3",
]
FSDP = ["dist.strategy=fsdp"]

# name -> (ranks, overrides). "ref_*" runs use on_write_error=warn: they train through every
# failed save, so their records are the uninterrupted trajectory the reruns must follow.
RUNS: dict[str, tuple[int, list[str]]] = {
    "one_inline_stop": (1, []),
    "ref_one_async_warn": (1, ["checkpoint.async_save=true", "checkpoint.on_write_error=warn"]),
    "two_sharded_inline_stop": (2, [*FSDP, "checkpoint.format=sharded", "+callbacks.limit.rank=1"]),
    "two_full_async_stop": (
        2,
        [*FSDP, "checkpoint.format=full", "checkpoint.async_save=true", "+callbacks.limit.rank=0"],
    ),
    "ref_two_sharded_async_warn": (
        2,
        [
            *FSDP,
            "checkpoint.format=sharded",
            "checkpoint.async_save=true",
            "checkpoint.on_write_error=warn",
            "+callbacks.limit.rank=1",
        ],
    ),
}
REFERENCE = {1: "ref_one_async_warn", 2: "ref_two_sharded_async_warn"}


def command(name: str, root: Path) -> list[str]:
    ranks, extra = RUNS[name]
    launcher = [sys.executable] if ranks == 1 else [*torchrun_cmd(ranks)]
    committed = root / name / "checkpoints" / "step_00000002"  # before the limit starts
    return [
        *launcher, "-m", "trainer.train", *BASE, *extra, f"hydra.run.dir={root / name}",
        f"+callbacks.limit.wait_for={committed}",
    ]  # fmt: skip


@dataclass
class Outcome:
    first: subprocess.CompletedProcess  # with writes failing
    checkpoints: list[str]  # in checkpoints/ after it (entries of every kind)
    last_step: int  # the last step it trained
    rerun: subprocess.CompletedProcess | None  # the same command, writes working


@pytest.fixture(scope="module")
def write_failures(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Outcome]]:
    """Every run with failing writes at once, then the reruns of those that stopped."""
    root = tmp_path_factory.mktemp("write_failures")
    first = launch_all({n: command(n, root) for n in RUNS}, TIMEOUT, CUMULUS_TEST_FSIZE="50000")
    seen = {n: (entries(root / n), max(losses(root / n), default=0)) for n in RUNS}
    again = launch_all({n: command(n, root) for n in RUNS if n.endswith("_stop")}, TIMEOUT)
    return root, {n: Outcome(first[n], *seen[n], again.get(n)) for n in RUNS}


def errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error")]


def losses(run_dir: Path) -> dict[int, list[tuple[float, float]]]:
    """Every training record's (loss, grad norm), by step: a step trained twice (before the
    failure and again after the resume) appears twice."""
    out: dict[int, list[tuple[float, float]]] = {}
    for r in read_metrics(run_dir):
        if "train/loss" in r:
            out.setdefault(r["step"], []).append((r["train/loss"], r["train/grad_norm"]))
    return out


def entries(run_dir: Path) -> list[str]:
    """What `checkpoints/` holds: committed checkpoints and anything left half-written."""
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [n for n in RUNS if n.endswith("_stop")])
def test_failed_write_stops_with_one_paragraph_and_the_rerun_resumes_exactly(
    write_failures: Any, name: str
) -> None:
    root, outcomes = write_failures
    out, run_dir = outcomes[name], root / name
    proc = out.first
    # The trainer exits 2 (bad input or environment); torchrun reports any failure as 1.
    assert proc.returncode == (2 if RUNS[name][0] == 1 else 1), explain(proc)
    # One paragraph, no traceback of ours (torchrun reports the exit code in its own words).
    assert not re.search(r'File ".*/(engine|trainer)/', proc.stderr), explain(proc)
    (error,) = errors(proc)
    failing_rank = 1 if "limit.rank=1" in " ".join(RUNS[name][1]) else 0
    # Async writes are found failed at the next checkpoint step, inline ones at once.
    stopped_at = 6 if "async" in name else 4
    assert f"checkpoint {run_dir / 'checkpoints' / 'step_00000004'} could not be written" in error
    # The limit cuts a write of Python's (EFBIG, named) or of torch's zip writer (a short
    # write: torch passes on no OS error), depending on which file crosses it.
    causes = ("[Errno 27] File too large", "a short write, the disk full or a file size limit")
    assert any(f"rank {failing_rank}: {cause}" in error for cause in causes), error
    assert f"newest committed checkpoint is {run_dir / 'checkpoints' / 'step_00000002'}" in error
    assert "checkpoint.on_write_error=warn" in error, error
    # Nothing half-written is left, and the last good checkpoint is untouched.
    assert out.checkpoints == ["step_00000002"], out.checkpoints
    assert out.last_step == stopped_at
    summary = f"run stopped: checkpoint write failed: step {stopped_at}/8"
    assert summary in proc.stdout, explain(proc)

    rerun = out.rerun
    assert rerun is not None and rerun.returncode == 0, explain(rerun)
    assert "resumed from" in rerun.stdout and "step_00000002" in rerun.stdout, explain(rerun)
    assert "run finished: step 8/8" in rerun.stdout, explain(rerun)
    ref = losses(root / REFERENCE[RUNS[name][0]])
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 9))
    for step, values in got.items():  # also steps 3-4(-6), trained before and after the resume
        assert all(v == ref[step][0] for v in values), (step, values, ref[step])
    assert entries(run_dir) == [f"step_{s:08d}" for s in (2, 4, 6, 8)], entries(run_dir)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(REFERENCE.values()))
def test_with_warn_training_goes_on_and_retries_every_checkpoint(
    write_failures: Any, name: str
) -> None:
    root, outcomes = write_failures
    proc, run_dir = outcomes[name].first, root / name
    assert proc.returncode == 0, explain(proc)
    warnings = [line for line in proc.stderr.splitlines() if "could not be written" in line]
    # Steps 4, 6 and 8 were each tried and failed; each warning names the next try.
    assert len(warnings) == 3, explain(proc)
    assert "tries again at step 6" in warnings[0] and "tries again at step 8" in warnings[1]
    assert "no checkpoint step left" in warnings[2], warnings
    assert outcomes[name].checkpoints == ["step_00000002"], outcomes[name].checkpoints
    assert sorted(losses(run_dir)) == list(range(1, 9))
    assert "run finished: step 8/8" in proc.stdout, explain(proc)
    assert f"newest checkpoint {run_dir / 'checkpoints' / 'step_00000002'}" in proc.stdout


# --------------------------------------------------------------------------- run-dir lock


@pytest.mark.multiproc
def test_second_launch_on_a_live_run_directory_is_refused(tmp_path: Path) -> None:
    """A live 1-process run holds the directory: a 2-rank launch on it exits 2 within seconds
    naming the holder, and writes nothing. After the holder is killed with -9, a rerun takes
    the lock over and resumes."""
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "train.max_steps=100000",
        "train.log_every=5",
        "checkpoint.every_steps=5",
        f"hydra.run.dir={run_dir}",
    ]
    live = ranks.start([sys.executable, "-m", "trainer.train", *args], 240)
    try:
        deadline = time.monotonic() + 120
        while not list((run_dir / "checkpoints").glob("step_*")):
            assert live.poll() is None and time.monotonic() < deadline, "the live run did not start"
            time.sleep(0.2)
        (live_pid,) = live.pids()
        holder = json.loads((run_dir / LOCK_NAME).read_text())
        assert holder["pid"] == live_pid and holder["host"] == socket.gethostname()

        started = time.monotonic()
        second = launch([*torchrun_cmd(2), "-m", "trainer.train", *args], 120, tmp_path)
        assert second.returncode != 0, explain(second)
        assert time.monotonic() - started < 60
        (error,) = [ln for ln in second.stderr.splitlines() if ln.startswith("error")]
        assert f"run directory {run_dir} is in use by another launch" in error, error
        assert f"pid {live_pid}" in error and socket.gethostname() in error, error
        assert holder["started"] in error, error
        records = read_metrics(run_dir)
        steps = [r["step"] for r in records]
        assert steps == sorted(set(steps)), "a second writer interleaved records"
    finally:
        live.collect()  # SIGKILLs its whole tree: a crash, not a stop
    last = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    resume = [*args, f"train.max_steps={last + 2}"]
    rerun = launch([sys.executable, "-m", "trainer.train", *resume], 120)
    assert rerun.returncode == 0, explain(rerun)
    assert "took over the lock" in rerun.stderr and f"pid {live_pid}" in rerun.stderr
    assert f"resumed from {run_dir / 'checkpoints'}" in rerun.stdout, explain(rerun)
    assert not (run_dir / LOCK_NAME).exists(), "the lock outlived its run"


def plant(run_dir: Path, age_s: float, **holder: Any) -> Path:
    """A lock file as another launch would have left it, last touched `age_s` ago."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({"token": "x", "started": "then", "job": "", **holder}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_lock_of_another_host_blocks_until_its_heartbeat_stops(tmp_path: Path) -> None:
    plant(tmp_path, 5.0, host="node-that-is-not-here", pid=1)
    with pytest.raises(RunDirInUse, match="host node-that-is-not-here, pid 1"):
        RunLock(tmp_path).acquire()
    plant(tmp_path, STALE_AFTER_S + 30, host="node-that-is-not-here", pid=1)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_of_a_live_or_reused_pid_on_this_host(tmp_path: Path) -> None:
    """A live pid blocks; the same pid with another start time (reused) does not."""
    parent = os.getppid()
    plant(tmp_path, 1.0, host=socket.gethostname(), pid=parent)
    with pytest.raises(RunDirInUse):
        RunLock(tmp_path).acquire()
    plant(tmp_path, 1.0, host=socket.gethostname(), pid=parent, pid_start="1")
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()


def test_an_elastic_restart_of_the_same_job_retakes_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun restarting its workers (same job id, restart count > 0) takes the lock of its
    earlier attempt once that one's heartbeat has stopped, even from another host; a fresh
    launch with the same job id (a requeue that reuses `--rdzv_id`) does not."""
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    plant(tmp_path, 1.0, host="other-node", pid=7, job="job42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(RunDirInUse, match="torchrun job job42"):
        RunLock(tmp_path).acquire()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    plant(tmp_path, 0.0, host="other-node", pid=7, job="job42")  # beating until just now
    lock = RunLock(tmp_path)
    lock.acquire()  # waits for two missed heartbeats, then takes over
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    lock.release()


def test_a_takeover_never_steals_a_fresh_lock(tmp_path: Path) -> None:
    """Two launches judged the same dead lock stale; the first took it over. The second's
    takeover finds the lock it moved is not the one it judged, puts it back and refuses."""
    plant(tmp_path, 1.0, host=socket.gethostname(), pid=999_999_999)  # dead
    dead = json.loads((tmp_path / LOCK_NAME).read_text())
    first = RunLock(tmp_path)
    first.acquire()
    second = RunLock(tmp_path)
    assert not second._take_over(dead)  # what it moved was `first`'s live lock: back it goes
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == first.token
    with pytest.raises(RunDirInUse):
        second.acquire()
    first.release()
