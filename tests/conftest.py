"""Shared helpers: compose the real config, run the real trainer (in-process or as a command)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from engine.distributed import DistInfo
from tests.ckpt_support import kill_tree
from trainer.cli import to_config
from trainer.config import register_configs
from trainer.identity import register_resolvers

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "configs"
# Fast, quiet defaults for tests; each test adds its own overrides after these.
TINY = [
    "model=gpt_tiny",
    "logger=none",
    "train.micro_batch_size=8",
    "train.grad_accum_steps=2",
    "train.max_steps=10",
    "train.log_every=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "scheduler.warmup_steps=2",
]

register_configs()
register_resolvers()
# In-process runs share 2 cores with the subprocesses tests launch; threads only contend.
torch.set_num_threads(1)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread (as OMP_NUM_THREADS=1 gives the subprocesses); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def stdlib_text(path: Path, n_bytes: int) -> Path:
    """The first `n_bytes` of the stdlib sources as one text file at `path`: real text that
    loads in milliseconds (all of `data.path=stdlib` takes seconds per launch)."""
    blob = b""
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        blob += source.read_bytes()
        if len(blob) >= n_bytes:
            break
    path.write_bytes(blob[:n_bytes])
    return path


def compose_config(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("train", overrides=overrides)


def train_in_process(overrides: list[str], run_dir: Path) -> list[dict[str, Any]]:
    """Run the real trainer in this process (one rank) and return its metrics records."""
    from trainer.train import train

    cfg, plain = to_config(compose_config(overrides))
    train(cfg, plain, DistInfo(), run_dir)
    return read_metrics(run_dir)


def strict_json(line: str) -> Any:
    """`json.loads` as strict parsers (jq, JavaScript) read: NaN and Infinity are errors."""

    def reject(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON: {line[:200]}")

    return json.loads(line, parse_constant=reject)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of `metrics.jsonl`, each line parsed as strict JSON."""
    path = Path(run_dir) / "metrics.jsonl"
    return [strict_json(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "train/loss" in r]


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    e.pop("WANDB_API_KEY", None)
    e.update(extra)
    return e


def run_cli(
    args: list[str],
    *,
    module: str = "trainer.train",
    timeout: float = 120,
    cwd: Path | None = None,
    **env_extra: str,
) -> subprocess.CompletedProcess:
    """`python -m <module> args` as a user would type it."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(**env_extra),
        cwd=cwd or REPO,
    )


def torchrun_cmd(nproc: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *extra,
    ]


def run_torchrun(
    nproc: int,
    args: list[str],
    *,
    module: str = "trainer.train",
    timeout: float = 180,
    launcher_args: tuple[str, ...] = (),
    cwd: Path | None = None,
    **env_extra: str,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N -m <module> args` (gloo on CPU)."""
    return subprocess.run(
        [*torchrun_cmd(nproc, *launcher_args), "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(**env_extra),
        cwd=cwd or REPO,
    )


def explain(proc: subprocess.CompletedProcess) -> str:
    out, err = proc.stdout[-4000:], proc.stderr[-6000:]
    return f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


@pytest.fixture
def tiny() -> list[str]:
    return list(TINY)


def launch(
    cmd: list[str], timeout: float = 120.0, tmp: Path | None = None, **env_extra: str
) -> subprocess.CompletedProcess:
    """Run `cmd` from the repo root with output in files (no pipe can fill up and block it).

    On timeout the whole process tree is killed (torchrun's workers too) and the test fails.
    `tmp` becomes TMPDIR, where torchrun leaves its `torchelastic_*` directories.
    """
    extra = {"TMPDIR": str(tmp)} if tmp is not None else {}
    extra.update(env_extra)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=REPO, env=env(**extra))
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(proc.pid)
            proc.wait()
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    if timed_out:
        pytest.fail(f"killed after {timeout:.0f} s (hang?): {' '.join(cmd)}\n{explain(result)}")
    return result


def launch_all(
    cmds: dict[str, list[str]], timeout: float, cwd: Path | None = None, **env_extra: str
) -> dict[str, subprocess.CompletedProcess]:
    """Run independent commands at once (mostly import-bound: this saves wall time on 2 cores),
    output in files. Past `timeout` kill each unfinished one *and* its workers, and fail.

    torchrun's workers live in their own sessions, so killing the launcher alone would leave
    them running: the whole process tree is killed by pid.
    """
    deadline = time.monotonic() + timeout
    results, late = {}, []
    with contextlib.ExitStack() as stack:
        started = {}
        for name, cmd in cmds.items():
            out = stack.enter_context(tempfile.TemporaryFile("w+"))
            err = stack.enter_context(tempfile.TemporaryFile("w+"))
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=err, text=True, cwd=cwd or REPO, env=env(**env_extra)
            )
            started[name] = (proc, out, err)
        for name, (proc, out, err) in started.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                late.append(name)
            out.seek(0)
            err.seek(0)
            results[name] = subprocess.CompletedProcess(
                cmds[name], proc.returncode, out.read(), err.read()
            )
    if late:
        pytest.fail(
            f"timed out after {timeout:.0f} s: "
            + "\n".join(f"{' '.join(cmds[n])}\n{explain(results[n])}" for n in late)
        )
    return results
