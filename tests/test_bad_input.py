"""Bad input through the real command: a clear one-paragraph error, non-zero exit, no traceback
wall, and nothing already saved is touched (CONTRACT.md, "Exit behaviour")."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.ranks import explain, run_cli
from trainer.models.gpt import GPT

TRACEBACK = "Traceback (most recent call last)"


def base_args(run_dir: Path) -> list[str]:
    return ["model=gpt_tiny", "logger=none", "train.max_steps=2", f"hydra.run.dir={run_dir}"]


def assert_clean_failure(proc: subprocess.CompletedProcess) -> None:
    """Non-zero exit by the program itself (not a signal) and no Python traceback anywhere."""
    assert proc.returncode != 0, f"bad input was accepted\n{explain(proc)}"
    assert proc.returncode > 0, f"killed by signal {-proc.returncode}\n{explain(proc)}"
    assert TRACEBACK not in proc.stderr, f"traceback on stderr\n{explain(proc)}"
    assert TRACEBACK not in proc.stdout, f"traceback on stdout\n{explain(proc)}"


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file under the run dir, by relative path, with its exact bytes."""
    return {
        p.relative_to(run_dir).as_posix(): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def assert_nothing_saved(run_dir: Path) -> None:
    """A rejected run starts nothing: no checkpoint, no metric record."""
    ckpts = run_dir / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir()), sorted(ckpts.iterdir())
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()


# --------------------------------------------------------------------------- one bad value each


@dataclass(frozen=True)
class Case:
    overrides: tuple[str, ...]
    key: str  # must appear in stderr
    hints: tuple[str, ...]  # each must appear in stderr (case-insensitive): what is valid


CASES = {
    "micro_zero": Case(("train.micro_batch_size=0",), "train.micro_batch_size", ("positive",)),
    "micro_negative": Case(("train.micro_batch_size=-1",), "train.micro_batch_size", ("positive",)),
    "accum_zero": Case(("train.grad_accum_steps=0",), "train.grad_accum_steps", ("positive",)),
    "max_steps_zero": Case(("train.max_steps=0",), "train.max_steps", ("positive",)),
    "precision_fp8": Case(("train.precision=fp8",), "train.precision", ("fp32", "bf16", "fp16")),
    "max_steps_ill_typed": Case(("train.max_steps=abc",), "train.max_steps", ("int",)),
    # What would be valid for a misspelt key: the keys that exist (at least the one meant).
    "unknown_key": Case(("train.stepz=1",), "train.stepz", ("max_steps",)),
    # Hydra's own advice for the error above: it must not turn the typo into a silent no-op.
    "unknown_key_appended": Case(("+train.stepz=1",), "train.stepz", ("max_steps",)),
    "missing_data_path": Case(
        ("data.path=/nonexistent/file.txt",), "data.path", ("/nonexistent/file.txt", "stdlib")
    ),
    "unknown_optimizer": Case(("optim.name=adam",), "optim.name", ("adamw", "sgd")),
    "global_batch_not_divisible": Case(
        ("train.global_batch_size=10", "train.micro_batch_size=4"),
        "train.global_batch_size",
        ("multiple", "8"),
    ),
    "missing_resume_path": Case(
        ("checkpoint.resume=/nonexistent/ckpt",),
        "checkpoint.resume",
        ("/nonexistent/ckpt", "auto", "never"),
    ),
    "unknown_strategy": Case(("dist.strategy=bogus",), "dist.strategy", ("ddp",)),
    "unknown_checkpoint_format": Case(
        ("checkpoint.format=zip",), "checkpoint.format", ("auto", "full", "sharded")
    ),
}


@pytest.mark.launches
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_clear_error(case: Case, tmp_path: Path) -> None:
    """The error names the key and what is valid; exit non-zero; no traceback."""
    run_dir = tmp_path / "run"
    proc = run_cli([*base_args(run_dir), *case.overrides])
    assert_clean_failure(proc)
    err = proc.stderr.lower()
    assert case.key.lower() in err, f"error does not name {case.key}\n{explain(proc)}"
    for hint in case.hints:
        assert hint.lower() in err, (
            f"error gives no hint {hint!r} of what is valid\n{explain(proc)}"
        )
    assert_nothing_saved(run_dir)


# --------------------------------------------------------------------------- saved state is safe

TRAIN = ["checkpoint.every_steps=1", "eval.every_steps=0"]


def train_ok(run_dir: Path) -> dict[str, bytes]:
    proc = run_cli([*base_args(run_dir), *TRAIN])
    assert proc.returncode == 0, explain(proc)
    saved = snapshot(run_dir)
    names = {n.split("/")[1] for n in saved if n.startswith("checkpoints/")}
    assert names == {"step_00000001", "step_00000002"}, sorted(saved)
    records = [json.loads(x) for x in saved["metrics.jsonl"].decode().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r], "no training records"
    return saved


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 2-step run with a checkpoint at each step (copied, never modified)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train_ok(run_dir)
    return run_dir


@pytest.mark.launches
def test_bad_rerun_leaves_saved_run_byte_identical(tmp_path: Path) -> None:
    """Train, then rerun the same run dir with a bad precision: every byte stays as it was."""
    run_dir = tmp_path / "run"
    before = train_ok(run_dir)
    proc = run_cli([*base_args(run_dir), *TRAIN, "train.precision=fp8"])
    assert_clean_failure(proc)
    assert "train.precision" in proc.stderr, explain(proc)
    after = snapshot(run_dir)
    assert sorted(after) == sorted(before), "files were added or removed"
    changed = [name for name in before if after[name] != before[name]]
    assert not changed, f"bad input modified saved files: {changed}"


# One bad input per stage that can reject a run: compose, build (data), resume.
RERUN_BAD = {
    "unknown_key": ["train.stepz=1"],
    "missing_data_path": ["data.path=/nonexistent/file.txt"],
    # resume=auto finds the saved checkpoint, which does not fit a wider model
    "checkpoint_does_not_fit": ["model.n_embd=64"],
}


@pytest.mark.launches
@pytest.mark.parametrize("bad", RERUN_BAD.values(), ids=RERUN_BAD.keys())
def test_bad_rerun_harms_nothing(bad: list[str], trained_run: Path, tmp_path: Path) -> None:
    """Errors raised at every stage (compose, validate, build, resume) leave the run alone."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    before = snapshot(run_dir)
    proc = run_cli([*base_args(run_dir), *TRAIN, *bad])
    assert_clean_failure(proc)
    after = snapshot(run_dir)
    assert sorted(after) == sorted(before), "files were added or removed"
    changed = [name for name in before if after[name] != before[name]]
    assert not changed, f"bad input modified saved files: {changed}"


# --------------------------------------------------------------------------- corrupt checkpoints


class _Payload:
    """Unpickling this runs os.mkdir(marker): a safe loader must refuse it unexecuted."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


def _random_dir(root: Path) -> Path:
    path = root / "random_dir"
    path.mkdir()
    (path / "blob.bin").write_bytes(os.urandom(512))
    return path


def _garbage_manifest(root: Path) -> Path:
    path = root / "step_00000001"
    path.mkdir()
    (path / "manifest.json").write_text("garbage {{{ not json")
    (path / "state.pt").write_bytes(os.urandom(256))
    return path


def _manifest_without_files(root: Path, trained: Path) -> Path:
    """The real format tag, nothing else: a truncated or hand-made manifest."""
    real = json.loads((trained / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    path = root / "step_00000001"
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"format": real["format"]}))
    return path


def _manifest_wrong_format(root: Path) -> Path:
    path = root / "step_00000001"
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"format": "other-tool/3", "files": {}}))
    return path


def _flipped_bytes(root: Path, trained: Path) -> Path:
    path = root / "step_00000002"
    shutil.copytree(trained / "checkpoints" / "step_00000002", path)
    state = bytearray((path / "state.pt").read_bytes())
    state[len(state) // 2] ^= 0xFF
    (path / "state.pt").write_bytes(bytes(state))
    return path


def _resealed(root: Path, trained: Path, state: dict) -> Path:
    """A copy of a real checkpoint with `state` as its state.pt and a manifest that matches:
    it passes the integrity check, so whatever fails is the content."""
    path = root / "step_00000002"
    shutil.copytree(trained / "checkpoints" / "step_00000002", path)
    torch.save(state, path / "state.pt")
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "state.pt").read_bytes()
    entry = manifest["files"]["state.pt"]
    entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _foreign_model(root: Path, trained: Path) -> Path:
    """Intact, but holds the weights of a different model shape."""
    state_file = trained / "checkpoints" / "step_00000002" / "state.pt"
    state = torch.load(state_file, weights_only=True)
    other = GPT(block_size=64, n_layer=1, n_head=2, n_embd=16)
    return _resealed(root, trained, {**state, "model": other.state_dict()})


def _unsafe_pickle(root: Path, trained: Path) -> Path:
    """Intact, but state.pt would run code when unpickled."""
    return _resealed(root, trained, {"model": _Payload(root / "PWNED")})


CORRUPT: dict[str, Callable[[Path, Path], Path]] = {
    "random_dir": lambda root, trained: _random_dir(root),
    "garbage_manifest": lambda root, trained: _garbage_manifest(root),
    "manifest_without_files": _manifest_without_files,
    "manifest_wrong_format": lambda root, trained: _manifest_wrong_format(root),
    "flipped_bytes": _flipped_bytes,
    "foreign_model": _foreign_model,
    "unsafe_pickle": _unsafe_pickle,
}


@pytest.mark.launches
@pytest.mark.parametrize("make", CORRUPT.values(), ids=CORRUPT.keys())
def test_corrupt_or_foreign_checkpoint(
    make: Callable[[Path, Path], Path], trained_run: Path, tmp_path: Path
) -> None:
    """`checkpoint.resume=<bad path>`: one paragraph naming the path, no traceback."""
    bad = tmp_path / "bad"
    bad.mkdir()
    path = make(bad, trained_run)
    run_dir = tmp_path / "run"
    proc = run_cli([*base_args(run_dir), f"checkpoint.resume={path}"])
    assert_clean_failure(proc)
    err = proc.stderr.strip()
    assert str(path) in err, f"error does not name {path}\n{explain(proc)}"
    assert "\n\n" not in err, f"error is not one paragraph\n{explain(proc)}"
    assert len(err.splitlines()) <= 6, f"error is a wall, not a paragraph\n{explain(proc)}"
    assert not (bad / "PWNED").exists(), "loading the checkpoint executed pickled code"
    assert_nothing_saved(run_dir)


@pytest.mark.launches
def test_payload_would_execute(trained_run: Path, tmp_path: Path) -> None:
    """The unsafe-pickle case is real: an unrestricted load does run the payload."""
    path = _unsafe_pickle(tmp_path, trained_run)
    torch.load(path / "state.pt", weights_only=False)
    assert (tmp_path / "PWNED").is_dir()
