"""Multi-process behaviour through the entry points (`torchrun -m trainer.train`, gloo).

Launches go through `tests/ranks.py` (warm ranks with torchrun's environment; the real
torchrun where the launch itself is under test). Runs that several tests read are made once
per module (`Runs`). Every launch has a deadline: on expiry its whole process tree is killed
and the test fails instead of hanging CI.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import ranks
from tests.conftest import REPO, read_metrics, train_records
from tests.dist_support import MARKER
from tests.ranks import explain, torchrun_cmd

pytestmark = pytest.mark.multiproc

BASE = [
    "model=gpt_tiny",
    "logger=none",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "train.log_every=1",
    "scheduler.warmup_steps=2",
]
STEPS = 8
LAUNCH_TIMEOUT = 90.0  # one gpt_tiny launch takes ~5-8 s on 2 busy cores
PROGRESS = re.compile(r"^\[[#-]{20}\] (\d+)/(\d+) \| loss ")
TRAIN_ARGS = [*BASE, f"train.max_steps={STEPS}"]


# --------------------------------------------------------------------------- launching


def launch(
    cmd: list[str], timeout: float = LAUNCH_TIMEOUT, cwd: Path = REPO, **env_extra: str
) -> subprocess.CompletedProcess:
    return ranks.launch(cmd, timeout, cwd=cwd, **env_extra)


def trainer_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainer.train", *args]


def torchrun_trainer(nproc: int, args: list[str]) -> list[str]:
    return [*torchrun_cmd(nproc), "-m", "trainer.train", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- shared runs


@dataclass
class Done:
    proc: subprocess.CompletedProcess
    run_dir: Path

    @property
    def records(self) -> list[dict[str, Any]]:
        return train_records(read_metrics(self.run_dir))


class Runs:
    """Runs several tests compare against, each launched at most once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[str, Done] = {}

    def _get(self, name: str, cmd_for: Callable[[list[str]], list[str]]) -> Done:
        if name not in self.cache:
            run_dir = self.root / name
            proc = launch(cmd_for([*TRAIN_ARGS, f"hydra.run.dir={run_dir}"]))
            assert proc.returncode == 0, explain(proc)
            self.cache[name] = Done(proc, run_dir)
        return self.cache[name]

    def single(self, packed: bool) -> Done:
        """One process, micro 16 x accum 1: the reference global batch of 16."""
        extra = [f"data.packed={str(packed).lower()}", "train.micro_batch_size=16"]
        return self._get(
            f"single_packed{packed}",
            lambda a: trainer_cmd([*a, *extra, "train.grad_accum_steps=1"]),
        )

    def ddp(self, packed: bool) -> Done:
        """2 ranks x micro 4 x accum 2: the same global batch of 16, split 8 ways."""
        extra = [f"data.packed={str(packed).lower()}", "train.micro_batch_size=4"]
        return self._get(
            f"ddp_packed{packed}",
            lambda a: torchrun_trainer(2, [*a, *extra, "train.grad_accum_steps=2"]),
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("dist_runs"))


def assert_same_trajectory(
    got: list[dict[str, Any]], want: list[dict[str, Any]], loss_atol: float = 1e-5
) -> None:
    """Same steps, `train/loss` within `loss_atol`, `train/grad_norm` within 1e-5 relative."""
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert math.isclose(g["train/loss"], w["train/loss"], rel_tol=0, abs_tol=loss_atol), (
            g["step"],
            g["train/loss"],
            w["train/loss"],
        )
        assert math.isclose(g["train/grad_norm"], w["train/grad_norm"], rel_tol=1e-5), (
            g["step"],
            g["train/grad_norm"],
            w["train/grad_norm"],
        )


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_two_ranks_match_one_process(runs: Runs, packed: bool) -> None:
    """The global-count loss normalization makes the rank x micro x accum split invisible,
    also with padded variable-length micro-batches (different token counts per rank)."""
    assert_same_trajectory(runs.ddp(packed).records, runs.single(packed).records)


def test_comm_hook_fires_only_on_last_micro_batch() -> None:
    """`no_sync` must hold back communication until the window's last micro-batch: one
    all-reduce round per optimizer step however many micro-batches it has."""
    accums, steps = [1, 4, 8], 4
    proc = launch(
        [
            *torchrun_cmd(2),
            "-m",
            "tests.dist_support",
            "--accum",
            *map(str, accums),
            "--steps",
            str(steps),
        ],
        timeout=60,
    )
    assert proc.returncode == 0, explain(proc)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    assert len(lines) == 1, explain(proc)  # rank 0 only
    result = json.loads(lines[0][len(MARKER) :])
    assert result["world_size"] == 2

    calls_per_step = {}
    for accum in accums:
        run = result["runs"][str(accum)]
        assert {c["micro"] for c in run["calls"]} == {accum - 1}, (accum, run["calls"])
        # DDP rebuilds its buckets after the first iteration: count from step 2 on.
        calls = [c for c in run["calls"] if c["step"] >= 2]
        per_step = [sum(c["step"] == s for c in calls) for s in range(2, steps + 1)]
        assert len(set(per_step)) == 1, (accum, per_step)
        calls_per_step[accum] = per_step[0]
        # The forwarding hook kept DDP's averaging and really synchronized the ranks.
        assert run["max_param_diff_vs_default_hook"] <= 1e-6, run
        assert run["max_param_diff_across_ranks"] == 0.0, run
    assert len(set(calls_per_step.values())) == 1, calls_per_step


def test_one_rank_raising_fails_the_job_fast(tmp_path: Path) -> None:
    """A worker dying mid-run must end the job quickly (no peer left waiting in a collective
    until the 600 s gloo timeout), with the root cause reported once, naming its rank."""
    args = [
        *TRAIN_ARGS,
        "train.micro_batch_size=4",
        f"hydra.run.dir={tmp_path}",
        # `+` for every key: `callbacks` starts as an empty dict in struct mode.
        "+callbacks.boom._target_=tests.dist_support.RaiseOnRank",
        "+callbacks.boom.rank=1",
        "+callbacks.boom.step=3",
    ]
    # ~6 s on an idle machine; the margin is for startup on a loaded CI runner. The property
    # itself (failure -> exit) is measured below, independent of load.
    proc = launch(torchrun_trainer(2, args), timeout=45)
    exited = time.time()
    assert proc.returncode != 0, explain(proc)
    raised = re.findall(
        r"RaiseOnRank: deliberate failure on rank 1 step 3 at unix time ([\d.]+)",
        proc.stderr,
    )
    assert len(raised) == 1, explain(proc)
    assert exited - float(raised[0]) < 15, explain(proc)
    # The traceback is headed by the component and step it came from.
    assert "[rank 1] error in a callback during step 3 (dist_support.py:" in proc.stderr, explain(
        proc
    )
    # rank 0 wrote steps 1-2 before rank 1 died after step 3's update.
    assert [r["step"] for r in train_records(read_metrics(tmp_path))][:2] == [1, 2]


def test_two_nodes_c10d_rendezvous_match_one_process(runs: Runs, tmp_path: Path) -> None:
    """The multi-node command of the contract, as two single-process nodes on localhost:
    2 nodes x micro 4 x accum 2 = global batch 16, the same as the 1-process reference.
    Real torchrun: the c10d rendezvous between two launchers is what is tested."""
    port, rdzv_id = free_port(), f"cumulus-test-{uuid.uuid4().hex[:8]}"
    args = [
        *TRAIN_ARGS,
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
        f"hydra.run.dir={tmp_path}",
    ]
    nodes = [
        ranks.start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id={rdzv_id}",
                "-m",
                "trainer.train",
                *args,
            ],
            LAUNCH_TIMEOUT,
            real=True,
        )
        for node in (0, 1)
    ]
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    ended = [node.ended_by(deadline) for node in nodes]
    procs = [node.collect() for node in nodes]  # kills a late one's tree
    assert all(ended), [("TIMED OUT\n" if not e else "") + explain(p) for e, p in zip(ended, procs)]
    for proc in procs:
        assert proc.returncode == 0, explain(proc)
    banners = sum("world 2 x micro 4 x accum 2 = global batch 16" in p.stdout for p in procs)
    assert banners == 1, [explain(p) for p in procs]
    assert_same_trajectory(train_records(read_metrics(tmp_path)), runs.single(True).records)


def test_default_run_dir_is_shared_by_all_ranks(tmp_path: Path) -> None:
    """Without hydra.run.dir, ranks resolving the timestamped default in different seconds
    must still agree on one directory; separate launches get separate ones. The skewed launch
    is real torchrun (`--no-python` starts rank 1 late, and the stamp is agreed on torchrun's
    own agent store); the first is warm (the same store protocol, emulated)."""
    outputs = tmp_path / "outputs"
    args = [*BASE, "train.max_steps=2", "train.micro_batch_size=4", "train.grad_accum_steps=1"]
    # The second launch starts rank 1 late enough to resolve the stamp in another second than
    # rank 0: a per-rank `${now:}` would then split the run in two (deterministically).
    skewed = [
        *torchrun_cmd(2),
        "--no-python",
        "bash",
        "-c",
        'if [ "$LOCAL_RANK" = 1 ]; then sleep 1.5; fi; exec "$CUMULUS_PY" -m trainer.train "$@"',
        "bash",
        *args,
    ]
    seen: set[Path] = set()
    for cmd in (torchrun_trainer(2, args), skewed):
        if seen:
            time.sleep(1.1)  # a new second: the next launch must get a new directory
        proc = launch(cmd, cwd=tmp_path, PYTHONPATH=str(REPO), CUMULUS_PY=sys.executable)
        assert proc.returncode == 0, explain(proc)
        metrics_files = sorted(outputs.rglob("metrics.jsonl"))
        dirs = {p.parent for p in metrics_files}
        new = dirs - seen
        assert len(new) == 1, (sorted(dirs), explain(proc))
        run_dir = new.pop()
        seen.add(run_dir)
        rel = run_dir.relative_to(outputs).as_posix()
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}", rel), rel
        assert (run_dir / ".hydra" / "config.yaml").is_file()
        assert [r["step"] for r in train_records(read_metrics(run_dir))] == [1, 2]
        assert str(run_dir) in proc.stdout, explain(proc)  # the banner names it
    # Nothing else: every directory under outputs/ is a date, each holding run directories.
    leaves = {p for p in outputs.glob("*/*") if p.is_dir()}
    assert leaves == seen, sorted(leaves)
    assert len(seen) == 2


def test_only_rank_zero_writes(runs: Runs) -> None:
    """Records and console progress come from rank 0 alone: one line per step, not one per
    rank (torchrun passes workers' stdout through unprefixed)."""
    done = runs.ddp(True)
    steps = [r["step"] for r in read_metrics(done.run_dir)]
    assert steps == list(range(1, STEPS + 1)), steps
    progress = [m for ln in done.proc.stdout.splitlines() if (m := PROGRESS.match(ln))]
    assert [int(m.group(1)) for m in progress] == list(range(1, STEPS + 1)), explain(done.proc)
    assert done.proc.stdout.count("cumulus | run dir") == 1, explain(done.proc)


def test_global_batch_size_derives_accumulation(tmp_path: Path) -> None:
    """global 16 / (micro 4 x world 2) = accum 2, overriding the given grad_accum_steps=1 (so
    the banner can't be the default's); global 12 is not a multiple of 8: a clear error."""
    base = [*BASE, "train.max_steps=1", "train.micro_batch_size=4", "train.grad_accum_steps=1"]
    ok = launch(
        torchrun_trainer(
            2, [*base, "train.global_batch_size=16", f"hydra.run.dir={tmp_path / 'ok'}"]
        )
    )
    assert ok.returncode == 0, explain(ok)
    assert "world 2 x micro 4 x accum 2 = global batch 16" in ok.stdout, explain(ok)

    bad = launch(
        torchrun_trainer(
            2, [*base, "train.global_batch_size=12", f"hydra.run.dir={tmp_path / 'bad'}"]
        )
    )
    assert bad.returncode != 0, explain(bad)
    assert "train.global_batch_size" in bad.stderr, explain(bad)
    assert "valid values are 8, 16, 24" in bad.stderr, explain(bad)
    # No worker traceback: no frames from our code, no "training failed". (torchrun's own
    # launcher prints a ChildFailedError traceback for any failed worker; that is not ours.)
    assert not re.search(r'File ".*/(trainer|engine)/', bad.stderr), explain(bad)
    assert "training failed" not in bad.stderr, explain(bad)
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
