"""kill -9 of the `torchrun` launcher: its workers notice that their parent is gone, stop at
a step boundary (saving it) within seconds, leave no half-written checkpoint, and the rerun
continues the trajectory of an uninterrupted run bit for bit.

torchrun's agent cannot clean up after SIGKILL (it has no chance to signal its workers), so
without this the workers trained to the end with no launcher, holding the run directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from engine.checkpoint import list_checkpoints, verify
from tests.conftest import REPO, complete_train_lines, read_metrics, train_records
from tests.ranks import _children, env, explain, kill_tree, launch_all, torchrun_cmd

# Dropout and variable-length samples (the RNG streams and the data position must resume),
# a constant learning rate (runs of different lengths share one trajectory).
ARGS = [
    "model=gpt_tiny",
    "logger=none",
    "train.log_every=1",
    "model.dropout=0.1",
    "data.packed=false",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    "scheduler=constant",
    "eval.every_steps=0",
    "checkpoint.every_steps=4",
]
GONE_WITHIN_S = 10.0
TIMEOUT = 180.0


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper has stopped running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def torchrun(args: list[str]) -> list[str]:
    return [*torchrun_cmd(2), "-m", "trainer.train", *ARGS, *args]


@pytest.mark.multiproc
def test_workers_stop_when_the_launcher_is_killed(tmp_path: Path) -> None:
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    metrics = run_dir / "metrics.jsonl"
    cmd = torchrun(["train.max_steps=100000", f"hydra.run.dir={run_dir}"])
    with tempfile.TemporaryFile("w+") as out:
        agent = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env()
        )
        workers: list[int] = []
        try:
            deadline = time.monotonic() + TIMEOUT
            while complete_train_lines(metrics) < 6:
                assert agent.poll() is None, "the run ended before its launcher was killed"
                assert time.monotonic() < deadline, "no 6 records in time"
                time.sleep(0.05)
            workers = _children(agent.pid)
            assert len(workers) == 2, workers
            agent.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            agent.wait()
            while any(alive(w) for w in workers) and time.monotonic() - killed < GONE_WITHIN_S:
                time.sleep(0.05)
            left = [w for w in workers if alive(w)]
            waited = time.monotonic() - killed
        finally:
            for w in workers:  # never leave them behind, whatever happened
                kill_tree(w)
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGKILL)
        out.seek(0)
        printed = out.read()
    assert not left, f"workers {left} still running {waited:.1f} s after the launcher died"
    assert "launcher" in printed and "is gone" in printed, printed[-3000:]

    # Only committed checkpoints, each complete; the newest is the step the run stopped at.
    root = run_dir / "checkpoints"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], list(root.iterdir())
    saved = list_checkpoints(root)
    for ckpt in saved:
        verify(ckpt)
    stopped = train_records(read_metrics(run_dir))[-1]["step"]
    assert saved[-1].name == f"step_{stopped:08d}", (saved, stopped)

    # The rerun continues from there, on the trajectory of a run that was never interrupted.
    steps = f"train.max_steps={stopped + 3}"
    done = launch_all(
        {
            "rerun": torchrun([steps, f"hydra.run.dir={run_dir}"]),
            "reference": torchrun([steps, f"hydra.run.dir={reference}"]),
        },
        TIMEOUT,
        TMPDIR=str(tmp_path),
    )
    for name, proc in done.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
    assert f"resumed from {saved[-1]} at step {stopped}" in done["rerun"].stdout
    got, want = train_records(read_metrics(run_dir)), train_records(read_metrics(reference))
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, stopped + 4))
    for a, b in zip(got, want):
        assert (a["train/loss"], a["train/grad_norm"]) == (b["train/loss"], b["train/grad_norm"]), (
            a["step"]
        )
