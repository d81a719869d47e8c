"""The warm launcher (tests/ranks.py) against the real torchrun it stands in for: the same
worker environment, a working agent store, the same exit codes and failure report, and
a one-process launch that ends like `python -m`. Most multi-rank tests rely on the warm
path; this is what keeps it honest. Real torchrun here on purpose: it is the reference."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import ranks
from tests.ranks import explain, launch_all, torchrun

# Values that differ from launch to launch, whatever the launcher.
PER_LAUNCH = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
TIMEOUT = 120.0


class Launched:
    """A finished probe launch: the launcher's result and the folder its ranks wrote to."""

    def __init__(self, proc: subprocess.CompletedProcess, out: Path) -> None:
        self.proc, self.out = proc, out

    def probes(self) -> dict[int, dict[str, Any]]:
        """Each rank's probe, by rank: one file per rank, never the shared stdout (real
        torchrun passes both ranks' stdout through one pipe, where lines interleave)."""
        found = [json.loads(p.read_text()) for p in sorted(self.out.glob("rank*.json"))]
        return {p["rank"]: p for p in found}


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Launched]:
    """Each mode under both launchers, all at once."""
    cmds, outs = {}, {}
    for mode in ("ok", "exit2", "kill9"):
        for launcher in ("warm", "real"):
            name = f"{launcher}_{mode}"
            outs[name] = tmp_path_factory.mktemp(name)
            cmds[name] = torchrun(2, [mode, str(outs[name])], module="tests.rank_probe")
    warm = launch_all({k: v for k, v in cmds.items() if k.startswith("warm")}, TIMEOUT)
    real = launch_all({k: v for k, v in cmds.items() if k.startswith("real")}, TIMEOUT, real=True)
    return {name: Launched(proc, outs[name]) for name, proc in {**warm, **real}.items()}


@pytest.mark.multiproc
def test_warm_ranks_get_torchrun_workers_environment(both: dict[str, Launched]) -> None:
    """The same variables with the same values (but for per-launch ones: port, run id), and
    the agent store reachable: every rank agrees on the first writer's value."""
    for launcher in ("warm", "real"):
        done = both[f"{launcher}_ok"]
        assert done.proc.returncode == 0, explain(done.proc)
        assert sorted(done.probes()) == [0, 1], explain(done.proc)
    warm, real = both["warm_ok"].probes(), both["real_ok"].probes()
    for rank in (0, 1):
        w, r = warm[rank]["env"], real[rank]["env"]
        assert sorted(w) == sorted(r), (rank, sorted(set(w) ^ set(r)))
        same = {k: (w[k], r[k]) for k in r if k not in PER_LAUNCH and w[k] != r[k]}
        assert not same, (rank, same)
        assert w["TORCHELASTIC_RUN_ID"] == warm[1 - rank]["env"]["TORCHELASTIC_RUN_ID"]
    for probe in (warm, real):
        assert probe[0]["agreed"] == probe[1]["agreed"] in ("rank0", "rank1"), probe


@pytest.mark.multiproc
@pytest.mark.parametrize(("mode", "code"), [("exit2", 2), ("kill9", -9)])
def test_a_failing_rank_ends_the_job_as_under_torchrun(
    both: dict[str, Launched], mode: str, code: int
) -> None:
    """Rank 1 fails (exit 2, or SIGKILL): the other rank is stopped, the launcher exits 1,
    and its report gives rank 1's own exit code, in torchrun's words."""
    for launcher in ("warm", "real"):
        done = both[f"{launcher}_{mode}"]
        proc = done.proc
        assert proc.returncode == 1, f"{launcher}\n{explain(proc)}"
        assert sorted(done.probes()) == [0, 1], f"{launcher}\n{explain(proc)}"
        assert f"failed (exitcode: {code}) local_rank: 1" in proc.stderr, explain(proc)
        assert re.search(rf"exitcode  : {code} \(pid: \d+\)", proc.stderr), explain(proc)
        assert "exitcode  : -15" in proc.stderr, explain(proc)  # rank 0, stopped by SIGTERM


@pytest.mark.launches
def test_one_process_ends_like_python(tmp_path: Any) -> None:
    """A one-process launch returns the process's own status: 0, the exit code, -9 when it
    SIGKILLs itself; stdout and stderr are its own. As `python -m`, warm and fresh."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import os, signal, sys\n"
        "print('out'); print('err', file=sys.stderr)\n"
        "how = sys.argv[1]\n"
        "if how == 'kill9': os.kill(os.getpid(), signal.SIGKILL)\n"
        "if how == 'raise': raise ValueError('boom')\n"
        "sys.exit({'ok': 0, 'exit3': 3}[how])\n"
    )
    want = {"ok": 0, "exit3": 3, "kill9": -9, "raise": 1}
    cmds = {f"{how}_{real}": [sys.executable, str(script), how] for how in want for real in "wr"}
    warm = launch_all({k: v for k, v in cmds.items() if k.endswith("w")}, TIMEOUT)
    fresh = launch_all({k: v for k, v in cmds.items() if k.endswith("r")}, TIMEOUT, real=True)
    for how, code in want.items():
        for proc in (warm[f"{how}_w"], fresh[f"{how}_r"]):
            assert proc.returncode == code, explain(proc)
            assert proc.stdout == "out\n", explain(proc)
            assert proc.stderr.startswith("err\n"), explain(proc)
        assert ("ValueError: boom" in warm[f"{how}_w"].stderr) == (how == "raise")
    assert ranks.warm_plan(cmds["ok_w"]) is not None  # the warm path really was taken
