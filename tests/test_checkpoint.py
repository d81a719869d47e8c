"""Checkpoints and resume through the entry points (`python -m trainer.train`, torchrun).

A crash is a SIGKILL at a chosen optimizer step (`tests.ckpt_support.KillOnce`); the rerun is
the same command. Every trajectory is compared with an independent reference: an
uninterrupted run of the same configuration, launched once per module. metrics.jsonl holds
floats at full precision (repr round-trips), so `==` on them is bitwise equality.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.checkpoint import CheckpointError, list_checkpoints, verify
from tests import ranks
from tests.conftest import REPO, complete_train_lines, read_metrics, train_records
from tests.ranks import explain, launch, torchrun_cmd

BASE = ["model=gpt_tiny", "logger=none", "train.log_every=1"]
# Dropout, variable-length samples, accumulation: a resume must restore the RNG streams, the
# data order and the optimizer. The LR warms up over 30 steps, longer than any run compared
# here, so it changes every step (the scheduler state matters) yet depends on the step only,
# not on train.max_steps: runs of different lengths share one reference.
NOISY = [*BASE, "model.dropout=0.1", "data.packed=false", "train.micro_batch_size=4"]
NOISY += ["train.grad_accum_steps=2", "scheduler=cosine", "scheduler.warmup_steps=30"]
STEPS = 20
SINGLE = [*NOISY, "checkpoint.every_steps=5"]
DDP = [*NOISY, "train.max_steps=12", "checkpoint.every_steps=5", "eval.every_steps=0"]
TRAIN_KEYS = ("train/loss", "train/grad_norm")
VAL_KEYS = ("val/loss", "val/sample")
SINGLE_TIMEOUT = 120.0  # a 20-step gpt_tiny run takes ~5 s on 2 idle cores
TORCHRUN_TIMEOUT = 180.0  # a 2-rank launch ~5-10 s, a restart ~3-10 s more
BANNER = re.compile(r"resumed from (\S+) at step (\d+)")


# --------------------------------------------------------------------------- launching


def trainer(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainer.train", *args]


def torchrun(args: list[str], *launcher_args: str) -> list[str]:
    return [*torchrun_cmd(2, *launcher_args), "-m", "trainer.train", *args]


def kill_at(step: int, marker: Path, rank: int = 0, wait_for: Path | None = None) -> list[str]:
    """Overrides that add the SIGKILL callback (harmless on the rerun: the marker exists)."""
    args = [
        "+callbacks.kill._target_=tests.ckpt_support.KillOnce",
        f"+callbacks.kill.step={step}",
        f"+callbacks.kill.marker={marker}",
        f"+callbacks.kill.rank={rank}",
    ]
    if wait_for is not None:
        args.append(f"+callbacks.kill.wait_for={wait_for}")
    return args


def killed(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


def resumed_steps(proc: subprocess.CompletedProcess) -> list[int]:
    """The step of every 'resumed from ... at step N' banner the command printed."""
    return [int(m.group(2)) for m in BANNER.finditer(proc.stdout + proc.stderr)]


def steps_of(records: list[dict[str, Any]]) -> list[int]:
    return [r["step"] for r in records]


def ckpt_names(run_dir: Path) -> list[str]:
    return [p.name for p in list_checkpoints(run_dir / "checkpoints")]


def last_by_step(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[int, tuple]:
    """The last record of each step wins: a resumed run appends redone steps again."""
    return {r["step"]: tuple(r.get(k) for k in keys) for r in records}


def superseded(run_dir: Path) -> list[dict[str, Any]]:
    """The records a resume moved out of metrics.jsonl (written after its checkpoint)."""
    path = run_dir / "metrics.superseded.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_same(
    got: list[dict[str, Any]],
    want: list[dict[str, Any]],
    keys: tuple[str, ...],
    upto: int | None = None,
) -> None:
    """Bitwise-equal `keys` at every step (up to step `upto`), and the same set of steps."""
    g, w = last_by_step(got, keys), last_by_step(want, keys)
    if upto is not None:
        g = {s: v for s, v in g.items() if s <= upto}
        w = {s: v for s, v in w.items() if s <= upto}
    assert sorted(g) == sorted(w), (sorted(g), sorted(w))
    diffs = [(s, g[s], w[s]) for s in sorted(w) if g[s] != w[s]]
    assert not diffs, f"{len(diffs)} step(s) differ from the uninterrupted run: {diffs[:4]}"


# --------------------------------------------------------------------------- references


class References:
    """Uninterrupted runs the tests compare against, each launched at most once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[str, Path] = {}

    def _get(self, name: str, cmd: list[str], timeout: float) -> Path:
        if name not in self.cache:
            run_dir = self.root / name
            proc = launch([*cmd, f"hydra.run.dir={run_dir}"], timeout, tmp=self.root)
            assert proc.returncode == 0, explain(proc)
            self.cache[name] = run_dir
        return self.cache[name]

    def single(self, eval_every: int = 0) -> Path:
        """One process, 20 steps, dropout, unpacked, checkpoints at 5/10/15/20."""
        cmd = trainer([*SINGLE, f"train.max_steps={STEPS}", f"eval.every_steps={eval_every}"])
        return self._get(f"single_eval{eval_every}", cmd, SINGLE_TIMEOUT)

    def ddp(self) -> Path:
        """2 ranks x micro 4 x accum 2, 12 steps, dropout, unpacked."""
        return self._get("ddp", torchrun(DDP), TORCHRUN_TIMEOUT)


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("ckpt_refs"))


# --------------------------------------------------------------------------- 1. kill -9


@pytest.mark.launches
@pytest.mark.parametrize(
    ("async_save", "eval_every", "fmt"),
    [(False, 0, "full"), (True, 5, "full"), (True, 5, "sharded")],
    ids=["sync", "async-eval", "sharded-async-eval"],
)
def test_sigkill_then_rerun_continues_the_same_trajectory(
    refs: References, tmp_path: Path, async_save: bool, eval_every: int, fmt: str
) -> None:
    """A crash mid-run loses nothing but the steps since the last checkpoint: the rerun of the
    same command resumes there and reproduces the uninterrupted run bit for bit."""
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    # With a background writer, die only once checkpoint 10 is committed (deterministic).
    ckpt10 = run_dir / "checkpoints" / "step_00000010"
    args = [
        *SINGLE,
        f"train.max_steps={STEPS}",
        f"eval.every_steps={eval_every}",
        f"checkpoint.async_save={str(async_save).lower()}",
        f"checkpoint.format={fmt}",
        f"hydra.run.dir={run_dir}",
        *kill_at(12, marker, wait_for=ckpt10),
    ]
    first = launch(trainer(args))
    assert killed(first) and marker.exists(), explain(first)
    assert steps_of(train_records(read_metrics(run_dir))) == list(range(1, 12))

    rerun = launch(trainer(args))
    assert rerun.returncode == 0, explain(rerun)
    assert resumed_steps(rerun) == [10], explain(rerun)
    records = read_metrics(run_dir)
    # One record per step: the killed run's step 11 (redone) moved to the superseded file.
    assert steps_of(train_records(records)) == list(range(1, STEPS + 1))
    assert steps_of(train_records(superseded(run_dir))) == [11]
    ref = read_metrics(refs.single(eval_every))
    assert_same(train_records(records), train_records(ref), TRAIN_KEYS)
    if eval_every:
        val = [r for r in records if "val/loss" in r]
        assert steps_of(val) == [5, 10, 15, 20]
        assert_same(val, [r for r in ref if "val/loss" in r], VAL_KEYS)


# --------------------------------------------------------------------------- 2. torchrun


@pytest.mark.multiproc
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_torchrun_restart_after_rank_death_resumes_exactly(
    refs: References, tmp_path: Path, fmt: str
) -> None:
    """torchrun --max-restarts=1 brings a job back after one rank is SIGKILLed: the restarted
    workers resume from the last checkpoint and continue the 2-rank trajectory exactly, from
    one gathered file or from the shards each rank wrote. Real torchrun: its restart of the
    workers (new pids, restart count, the shared agent store) is what is tested."""
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    args = [*DDP, f"checkpoint.format={fmt}", f"hydra.run.dir={run_dir}"]
    args += kill_at(7, marker, rank=1)
    proc = launch(torchrun(args, "--max-restarts=1"), TORCHRUN_TIMEOUT, tmp=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert marker.exists(), "rank 1 was never killed: the test did not test a restart"
    assert resumed_steps(proc) == [5], explain(proc)
    got = train_records(read_metrics(run_dir))
    assert steps_of(got) == list(range(1, 13))
    # The killed attempt's records after checkpoint 5 (step 6 at least) are superseded.
    moved = steps_of(train_records(superseded(run_dir)))
    assert moved and moved == list(range(6, 6 + len(moved))), moved
    assert_same(got, train_records(read_metrics(refs.ddp())), TRAIN_KEYS)


# --------------------------------------------------------------------------- 3. truncated


@pytest.mark.launches
def test_truncated_newest_checkpoint_is_skipped(refs: References, tmp_path: Path) -> None:
    """A checkpoint damaged after its commit (disk full, bad copy) is skipped with a warning;
    the resume falls back to the previous one and still reproduces the reference."""
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    args = [
        *SINGLE,
        f"train.max_steps={STEPS}",
        "eval.every_steps=0",
        "checkpoint.keep_last=3",
        f"hydra.run.dir={run_dir}",
        *kill_at(12, marker),
    ]
    first = launch(trainer(args))
    assert killed(first), explain(first)
    assert ckpt_names(run_dir) == ["step_00000005", "step_00000010"]
    state = run_dir / "checkpoints" / "step_00000010" / "state.pt"
    size = state.stat().st_size
    with state.open("r+b") as f:
        f.truncate(size // 2)

    rerun = launch(trainer(args))
    assert rerun.returncode == 0, explain(rerun)
    assert re.search(r"WARNING.*step_00000010", rerun.stderr), explain(rerun)
    assert resumed_steps(rerun) == [5], explain(rerun)
    got = train_records(read_metrics(run_dir))
    assert steps_of(got) == list(range(1, STEPS + 1))
    assert steps_of(train_records(superseded(run_dir))) == list(range(6, 12))
    assert_same(got, train_records(read_metrics(refs.single(0))), TRAIN_KEYS)
    # The damaged checkpoint was replaced by a good one when step 10 was saved again.
    assert ckpt_names(run_dir) == ["step_00000010", "step_00000015", "step_00000020"]
    assert verify(run_dir / "checkpoints" / "step_00000010")["step"] == 10


# --------------------------------------------------------------------------- 4. malicious


class _Payload:
    """Unpickling this runs `touch marker`: what an unsafe `torch.load` would execute."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _plant(ckpt: Path, name: str, marker: Path, zip_format: bool) -> Path:
    """Replace `ckpt/name` by a code-running pickle and re-sign the manifest, so that only the
    safe loader stands between the file and execution."""
    path = ckpt / name
    if zip_format:
        torch.save({"model": _Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps({"model": _Payload(marker)}))
    # The payload is live: an unsafe load really runs it.
    if zip_format:
        torch.load(path, weights_only=False)
    else:
        pickle.loads(path.read_bytes())
    assert marker.exists()
    marker.unlink()
    manifest_path = ckpt / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = path.read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))
    assert verify(ckpt)
    return path


@pytest.mark.launches
@pytest.mark.parametrize(
    ("resume", "name", "zip_format"),
    [("path", "state.pt", True), ("path", "rank_00000.pt", False), ("auto", "state.pt", False)],
    ids=["path-state-zip", "path-rank-pickle", "auto-state-pickle"],
)
def test_malicious_pickle_is_refused_and_never_executed(
    refs: References, tmp_path: Path, resume: str, name: str, zip_format: bool
) -> None:
    """A checkpoint is untrusted input: a pickle that would run code is refused with one
    paragraph naming the file, nothing runs, and `auto` does not silently start fresh."""
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    ckpt = run_dir / "checkpoints" / "step_00000020"
    shutil.copytree(refs.single(0) / "checkpoints" / "step_00000020", ckpt)
    bad = _plant(ckpt, name, marker, zip_format)
    where = "auto" if resume == "auto" else str(ckpt)
    args = [*SINGLE, f"train.max_steps={STEPS}", "eval.every_steps=0", f"checkpoint.resume={where}"]
    proc = launch(trainer([*args, f"hydra.run.dir={run_dir}"]))
    assert proc.returncode > 0, explain(proc)  # an error exit, not a crash by signal
    assert str(bad) in proc.stderr and "refused" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert not marker.exists(), "the malicious pickle was executed"
    assert not (run_dir / "metrics.jsonl").exists(), "it trained instead of failing"
    assert ckpt.is_dir(), "the refused checkpoint was deleted"


# --------------------------------------------------------------------------- 5. SIGTERM


@pytest.mark.launches
def test_sigterm_saves_the_current_step_and_exits_zero(refs: References, tmp_path: Path) -> None:
    """Schedulers send SIGTERM before a kill: the run checkpoints the step it is at and exits
    cleanly, and the rerun resumes from exactly that step on the reference trajectory."""
    run_dir = tmp_path / "run"
    args = [*NOISY, "eval.every_steps=0", "checkpoint.every_steps=100000"]
    args.append(f"hydra.run.dir={run_dir}")
    run = ranks.start(trainer([*args, "train.max_steps=100000"]), SINGLE_TIMEOUT)
    ended = False
    try:
        deadline = time.monotonic() + SINGLE_TIMEOUT
        while complete_train_lines(run_dir / "metrics.jsonl") < 3:
            assert run.poll() is None, "the run ended before it was signalled"
            assert time.monotonic() < deadline, "no 3 records in time"
            time.sleep(0.02)
        run.send_signal(signal.SIGTERM)
        ended = run.ended_by(time.monotonic() + 60)
    finally:
        proc = run.collect()  # killed (its whole tree) if still running
    assert ended, f"still running 60 s after SIGTERM\n{explain(proc)}"
    rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    assert rc == 0, stderr[-4000:]
    assert "stop requested" in stderr, stderr[-4000:]
    last = train_records(read_metrics(run_dir))[-1]["step"]
    assert ckpt_names(run_dir) == [f"step_{last:08d}"]
    # The end-of-run summary: how it ended, where, and what it left.
    summary = stdout[stdout.index("run stopped by request") :]
    assert f"step {last}/100000" in summary, summary
    assert f"newest checkpoint {run_dir / 'checkpoints' / f'step_{last:08d}'}" in summary
    assert verify(run_dir / "checkpoints" / f"step_{last:08d}")["step"] == last

    rerun = launch(trainer([*args, f"train.max_steps={last + 3}"]))
    assert rerun.returncode == 0, explain(rerun)
    assert resumed_steps(rerun) == [last], explain(rerun)
    got = train_records(read_metrics(run_dir))
    assert steps_of(got) == [*range(1, last + 4)]
    ref = train_records(read_metrics(refs.single(0)))
    assert_same(got, ref, TRAIN_KEYS, upto=min(last + 3, STEPS))


# --------------------------------------------------------------------------- 6. atomicity


@pytest.mark.launches
def test_keep_last_tmp_leftovers_and_manifest(tmp_path: Path) -> None:
    """Only committed checkpoints exist: `keep_last` prunes old ones, no temporary directory
    survives a run, a crashed save's leftover is removed at startup and never resumed from,
    and a checkpoint without its manifest is not a checkpoint."""
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    args = [
        *BASE,
        "train.micro_batch_size=4",
        "eval.every_steps=0",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=2",
        "checkpoint.async_save=true",
        f"hydra.run.dir={run_dir}",
    ]
    first = launch(trainer([*args, "train.max_steps=10"]))
    assert first.returncode == 0, explain(first)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000008", "step_00000010"]

    # A complete-looking save of step 12 that crashed before its rename.
    leftover = root / ".tmp-step_00000012-crashed"
    shutil.copytree(root / "step_00000010", leftover)
    manifest = json.loads((leftover / "manifest.json").read_text())
    (leftover / "manifest.json").write_text(json.dumps({**manifest, "step": 12}))
    # Killed at step 11, before any save of its own: whatever cleaned up did so at startup.
    rerun = launch(trainer([*args, "train.max_steps=12", *kill_at(11, marker)]))
    assert killed(rerun), explain(rerun)
    assert resumed_steps(rerun) == [10], explain(rerun)
    assert "step_00000010" in BANNER.search(rerun.stdout).group(1)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000008", "step_00000010"]

    no_manifest = tmp_path / "step_00000010"
    shutil.copytree(root / "step_00000010", no_manifest)
    (no_manifest / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest"):
        verify(no_manifest)
    flipped = tmp_path / "flipped" / "step_00000010"
    shutil.copytree(root / "step_00000010", flipped)
    data = bytearray((flipped / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte differs
    (flipped / "state.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        verify(flipped)


# --------------------------------------------------------------------------- 7. extend


@pytest.mark.launches
def test_rerun_with_more_steps_extends_a_finished_run(refs: References, tmp_path: Path) -> None:
    """A finished run rerun with a larger train.max_steps continues from its final checkpoint
    and appends the new steps, on the trajectory of a run that was that long from the start."""
    run_dir = tmp_path / "run"
    args = [*SINGLE, "eval.every_steps=0", f"hydra.run.dir={run_dir}"]
    first = launch(trainer([*args, "train.max_steps=10"]))
    assert first.returncode == 0, explain(first)
    more = launch(trainer([*args, "train.max_steps=14"]))
    assert more.returncode == 0, explain(more)
    assert resumed_steps(more) == [10], explain(more)
    got = train_records(read_metrics(run_dir))
    assert steps_of(got) == list(range(1, 15))
    assert_same(got, train_records(read_metrics(refs.single(0))), TRAIN_KEYS, upto=14)


# --------------------------------------------------------------------------- 8. world size


@pytest.mark.multiproc
def test_resume_on_another_world_size(tmp_path: Path) -> None:
    """A 2-rank checkpoint resumes in one process with the same global batch: weights and
    optimizer state carry over (losses track the 2-rank run), RNG is reseeded with a warning."""
    args = [*BASE, "eval.every_steps=0", "train.max_steps=8", "checkpoint.every_steps=5"]
    ddp_dir, run_dir = tmp_path / "ddp", tmp_path / "single"
    ddp_args = [*args, "train.micro_batch_size=4", "train.grad_accum_steps=2"]
    ddp = launch(torchrun([*ddp_args, f"hydra.run.dir={ddp_dir}"]), TORCHRUN_TIMEOUT, tmp_path)
    assert ddp.returncode == 0, explain(ddp)
    name = "step_00000005"
    shutil.copytree(ddp_dir / "checkpoints" / name, run_dir / "checkpoints" / name)

    single_args = [*args, "train.micro_batch_size=8", "train.grad_accum_steps=2"]
    proc = launch(trainer([*single_args, f"hydra.run.dir={run_dir}"]))
    assert proc.returncode == 0, explain(proc)
    assert resumed_steps(proc) == [5], explain(proc)
    assert re.search(r"WARNING.*2 ranks.*reseeded", proc.stderr), explain(proc)
    assert "global batch" not in proc.stderr, explain(proc)
    got = train_records(read_metrics(run_dir))
    want = {r["step"]: r for r in train_records(read_metrics(ddp_dir))}
    assert steps_of(got) == [6, 7, 8]
    for r in got:  # step 7+ depend on the restored AdamW moments too
        w = want[r["step"]]["train/loss"]
        assert math.isclose(r["train/loss"], w, rel_tol=0, abs_tol=1e-4), (r["step"], w)


@pytest.mark.launches
def test_checkpoint_modules_import_one_way() -> None:
    """manifest <- writer <- DCP layout: the manifest and the writer import no layout, and
    nothing of DCP is imported until a sharded checkpoint is written or read."""
    code = (
        "import sys, engine.checkpoint, trainer.run.state, trainer.run.build\n"
        "bad = [m for m in ('engine.checkpoint.sharded', 'torch.distributed.checkpoint')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = launch([sys.executable, "-c", code], SINGLE_TIMEOUT)  # a fresh interpreter
    assert proc.returncode == 0, proc.stderr
    # (The files moved to engine/checkpoint/ with the layout by concern: the same checks.)
    for module in ("manifest", "writer"):
        source = (REPO / "engine" / "checkpoint" / f"{module}.py").read_text()
        assert "checkpoint.sharded import" not in source, module
    assert "checkpoint.writer import" not in (REPO / "engine/checkpoint/manifest.py").read_text()
