"""scripts/ft_local.sh, the one-machine launcher of `ft=torchft` (docs/guides/fault-tolerance.md):
it starts the lighthouse and each replica group under torchrun --max-restarts, so a group
SIGKILLed mid-run is restarted by its own torchrun, takes its peer's state and trains on;
the run ends with one record per step, and the launcher exits 0. Bad input reaches the
terminal and stops the launcher without a relaunch loop.

One launch of the script for the module (2 groups of 1 process, gpt_tiny): its run is shared
by the tests below."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, read_metrics, stdlib_text, train_records

pytest.importorskip("torchft", reason="the extra `ft` (torchft) is not installed")

pytestmark = pytest.mark.multiproc

SCRIPT = REPO / "scripts" / "ft_local.sh"
STEPS = 24
KILL_STEP = 3


@dataclass
class Launched:
    proc: subprocess.CompletedProcess
    run_dir: Path
    markers: Path

    def log(self, group: int) -> str:
        return (self.run_dir / "ft" / f"group{group}.log").read_text()


def ft_local(
    run_dir: Path, *overrides: str, timeout: float = 240, **more_env: str
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "RUST_LOG": "warn",
        "FT_HEARTBEAT_TIMEOUT_S": "1",
        "FT_MIN_LAUNCH_S": "0",
        **more_env,
    }
    cmd = ["bash", str(SCRIPT), "2", "1", "--", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    root = tmp_path_factory.mktemp("ft_local")
    text = stdlib_text(root / "text.txt", 100_000)
    run_dir, markers = root / "run", root / "markers"
    proc = ft_local(
        run_dir,
        "model=gpt_tiny",
        "logger=none",
        f"data.path={text}",
        f"train.max_steps={STEPS}",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.log_every=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "+callbacks.slow._target_=tests.ft_support.Slowdown",
        "+callbacks.slow.seconds=0.25",  # the run outlasts the killed group's restart
        "+callbacks.kill._target_=tests.ft_support.KillGroup",
        f"+callbacks.kill.kills='{KILL_STEP}:forward'",
        f"+callbacks.kill.markers={markers}",
        f"+callbacks.kill.until={STEPS - 6}",
        "+callbacks.kill.group=1",
    )
    return Launched(proc, run_dir, markers)


def explain(launched: Launched) -> str:
    logs = "\n".join(
        f"=== group {g}\n{launched.log(g)[-3000:]}"
        for g in (0, 1)
        if (launched.run_dir / "ft" / f"group{g}.log").exists()
    )
    return f"exit {launched.proc.returncode}\n{launched.proc.stderr[-2000:]}\n{logs}"


def test_a_killed_group_is_restarted_by_its_torchrun(launched: Launched) -> None:
    assert launched.proc.returncode == 0, explain(launched)
    assert (launched.markers / f"{KILL_STEP}-forward").exists(), explain(launched)
    log = launched.log(1)
    assert "KillGroup: killing the group" in log, explain(launched)
    # torchrun's agent saw its worker die and started it again (one launch of the script's)
    assert "launching again" not in log and " joined at step " in log, explain(launched)


def test_the_run_has_one_record_per_step_and_the_failure_said(launched: Launched) -> None:
    records = train_records(read_metrics(launched.run_dir))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), explain(launched)
    assert records[-1]["ft/failures"] >= 1 and records[-1]["ft/redone_steps"] >= 1, records[-1]
    assert {r["train/groups"] for r in records} == {1, 2}, records
    assert "lighthouse http://" in launched.proc.stdout, launched.proc.stdout[-2000:]
    assert "[group 0] " in launched.proc.stdout and " lost at step " in launched.proc.stdout


def test_bad_input_stops_the_launcher_in_one_paragraph(tmp_path: Path) -> None:
    """A refused config: each group says it in one paragraph (the trainer's; torchrun's agent
    adds its own report of a failed worker) and the launcher exits 2 without relaunching:
    every relaunch would say the same."""
    proc = ft_local(tmp_path / "run", "model=gpt_tiny", "dist.tp=2", FT_MAX_RESTARTS="0")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    for g in (0, 1):
        log = (tmp_path / "run" / "ft" / f"group{g}.log").read_text()
        said = [ln for ln in log.splitlines() if ln.startswith("error: invalid config `dist.tp`")]
        assert len(said) == 1 and f'File "{REPO}' not in log, log[-3000:]
        assert "launching again" not in log, log[-2000:]
