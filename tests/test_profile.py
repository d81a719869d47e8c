"""Where a step's time goes, on 2 gloo ranks: one rank slowed in one place and named for it,
a profiled window merged into one timeline, and a hung rank named.

Four independent runs start together (`launch_all`) and every assertion reads them:
- `data`: rank 1 reads each training sample 30 ms slower (tests/profile_support.py);
- `compute`: rank 1 sleeps 0.5 s inside each step's compute, before the gradient all-reduce;
- `profiled`: `compute` with `profile=torch profile.steps=[3,4]`;
- `hang`: rank 1 stops in step 3 (checkpoints at steps 2, 4...) under `dist.timeout_s=20`.
The references are the slowdowns the runs were given: which rank was slowed, and where.
"""

from __future__ import annotations

import gzip
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import read_metrics, stdlib_text, train_records
from tests.ranks import explain, launch_all, run_cli, torchrun
from trainer.checks.compare import compare
from trainer.tracking.timeline import load_trace, merge_traces, phase_lanes

pytestmark = pytest.mark.multiproc

SUPPORT = "tests.profile_support"
STEPS = 6
COMMON = [
    "model=gpt_tiny",
    "logger=none",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "scheduler.warmup_steps=2",
]
SLOW_COMPUTE = [f"+callbacks.slow._target_={SUPPORT}.SlowCompute", "+callbacks.slow.seconds=0.5"]
ARGS = {
    "data": [*COMMON, f"data._target_={SUPPORT}.slow_data", "+data.rank=1", "+data.delay_s=0.03"],
    "compute": [*COMMON, *SLOW_COMPUTE],
    "profiled": [*COMMON, *SLOW_COMPUTE, "profile=torch", "profile.steps=[3,4]"],
    "hang": [
        *COMMON,
        "train.max_steps=8",
        "checkpoint.every_steps=2",
        "dist.timeout_s=20",
        f"+callbacks.hang._target_={SUPPORT}.Hang",
        "+callbacks.hang.step=3",
    ],
}
HOST = socket.gethostname()


class Runs:
    def __init__(self, root: Path) -> None:
        self.dirs = {name: root / name for name in ARGS}
        text = stdlib_text(root / "text.py", 200_000)  # loads in milliseconds
        cmds = {
            n: torchrun(2, [*a, f"data.path={text}", f"hydra.run.dir={self.dirs[n]}"])
            for n, a in ARGS.items()
        }
        started = time.monotonic()
        self.procs = launch_all(cmds, timeout=240)
        self.seconds = time.monotonic() - started  # the hung job's end bounds it

    def records(self, name: str) -> list[dict[str, Any]]:
        return train_records(read_metrics(self.dirs[name]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    runs = Runs(tmp_path_factory.mktemp("profile"))
    for name in ("data", "compute", "profiled"):
        assert runs.procs[name].returncode == 0, explain(runs.procs[name])
    return runs


@pytest.fixture(scope="module")
def timeline(runs: Runs) -> dict[str, Any]:
    """The profiled run's merged timeline, loaded once."""
    return load_trace(runs.dirs["profiled"] / "profile" / "timeline.json.gz")


def straggler_lines(proc: Any) -> list[str]:
    """Rank 0's console lines naming a slowest rank (only rank 0 prints them)."""
    return [line for line in proc.stdout.splitlines() if line.startswith("slowest rank")]


def test_slow_data_rank_is_named(runs: Runs) -> None:
    """Rank 1's 30 ms per sample (8 samples a step) make it the slowest in `data` in every
    record, by about 0.24 s, and the console names it, its host and its input."""
    records = runs.records("data")
    assert len(records) == STEPS
    assert [r["time/data_rank"] for r in records] == [1] * STEPS, records
    assert all(r["time/data_s"] >= 0.2 for r in records)
    assert all(r["time/data_min_s"] < r["time/data_s"] / 2 for r in records)
    # The fast rank waits for the slow one inside the window's first all-reduce.
    assert sum(r["time/sync_rank"] == 0 for r in records) >= STEPS - 1
    lines = straggler_lines(runs.procs["data"])
    assert lines and lines[0].startswith(f"slowest rank 1 ({HOST}): data "), lines
    assert "input" in lines[0]
    # Its slow input is never counted as compute. (The other rank may be named for compute
    # on a machine this loaded: 2 ranks on 2 shared cores, one clearly slower by chance.)
    assert not any(ln.startswith("slowest rank 1 ") and ": compute " in ln for ln in lines), lines


def test_slow_compute_rank_is_named_as_compute(runs: Runs) -> None:
    """Rank 1's 0.5 s inside its forward/backward is compute, not data: the all-reduce of the
    last micro-batch makes rank 0 wait for it, and that wait is rank 0's `sync`, not its
    compute. The console names rank 1's compute."""
    records = runs.records("compute")
    assert sum(r["time/compute_rank"] == 1 for r in records) >= STEPS - 1, records
    assert sum(r["time/sync_rank"] == 0 for r in records) >= STEPS - 1, records
    assert sum(r["time/sync_s"] >= 0.2 for r in records) >= STEPS - 1, records
    lines = straggler_lines(runs.procs["compute"])
    assert lines and lines[0].startswith(f"slowest rank 1 ({HOST}): compute "), lines
    # Its slow compute is never counted as input (the other rank's, on a loaded machine, may).
    assert not any(ln.startswith("slowest rank 1 ") and ": data " in ln for ln in lines), lines


def test_phase_keys_stay_out_of_comparisons(runs: Runs) -> None:
    """`time/*` (seconds and ranks) measure the machine: `trainer.compare` leaves them out.
    The data and compute runs train the same samples, so everything else agrees."""
    a, b = runs.records("data"), runs.records("compute")
    assert [r["time/data_rank"] for r in a] != [r["time/data_rank"] for r in b] or [
        r["time/compute_rank"] for r in a
    ] != [r["time/compute_rank"] for r in b]
    diffs, only = compare(runs.dirs["data"], runs.dirs["compute"])
    assert all(d.within for d in diffs), diffs
    assert not any(d.metric.startswith("time/") for d in diffs)
    assert not any(m.startswith("time/") for m in only["a"] + only["b"])


def test_profiling_changes_no_loss(runs: Runs) -> None:
    """Losses and gradient norms with profiling on and off are bit-identical; the profiled
    steps (and the warm-up before them) are flagged and have no throughput."""
    on, off = runs.records("profiled"), runs.records("compute")
    for key in ("train/loss", "train/grad_norm"):
        assert [r[key] for r in on] == [r[key] for r in off], key
    flagged = [r["step"] for r in on if r.get("time/profiled")]
    assert flagged == [2, 3, 4]
    assert all("train/tokens_per_s" not in r for r in on if r["step"] in flagged)
    assert all(r["train/tokens_per_s"] > 0 for r in on if r["step"] not in flagged)
    # kineto's lines where tracing starts and stops (`USDT:... profiler_start`) are left out.
    assert "USDT" not in runs.procs["profiled"].stderr, runs.procs["profiled"].stderr[-2000:]


def test_profiled_window_is_one_timeline(runs: Runs, timeline: dict[str, Any]) -> None:
    """Each rank wrote its gzipped trace; the merged timeline holds both as processes `rank 0`
    and `rank 1`, each with the spans of steps 3 and 4, their phases and micro-batches; flow
    ids are unique; the summary has the top operators of each rank."""
    folder = runs.dirs["profiled"] / "profile"
    for rank in (0, 1):
        with gzip.open(folder / f"rank{rank}.trace.json.gz", "rt") as f:
            assert json.load(f)["traceEvents"]
    events = timeline["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    assert names == {0: f"rank 0 ({HOST})", 1: f"rank 1 ({HOST})"}
    assert {e["pid"] for e in events} == {0, 1}
    flows = [(e["pid"], e["id"], e["ph"]) for e in events if e.get("ph") in ("s", "f")]
    assert len(flows) == len(set(flows))
    for rank in (0, 1):
        spans = {
            e["name"]
            for e in events
            if e["pid"] == rank and e.get("cat") == "user_annotation" and e.get("ph") == "X"
        }
        assert {"step 3", "step 4", "data", "compute", "optimizer"} <= spans, spans
        assert {"micro-batch 1/2", "micro-batch 2/2", "sync (gradient sync)"} <= spans, spans
    lanes = phase_lanes(timeline)
    assert [name for name, _, _ in lanes[0]["steps"]] == ["step 3", "step 4"]
    summary = (runs.dirs["profiled"] / "summary.txt").read_text()
    assert "profile: steps 3-4 of rank(s) 0,1" in summary
    table = summary[summary.index("operator") :].splitlines()
    assert any(re.match(r"\s+0\s+\S", line) for line in table), summary
    assert any(re.match(r"\s+1\s+\S", line) for line in table), summary
    report = (runs.dirs["profiled"] / "report.html").read_text()
    assert report.count('class="phase" data-rank="1"') > 0
    assert report.count('class="phase" data-rank="0"') > 0
    assert not re.search(r"\b(?:https?|ftp|file):|//[\w.-]+\.\w", report)  # self-contained


def test_clocks_of_another_host_are_aligned(
    runs: Runs, timeline: dict[str, Any], tmp_path: Path
) -> None:
    """Rank 1's trace moved to a host whose clock runs 5 s ahead is put back on rank 0's
    clock: the collective both left together ends at the same moment again (to within the
    jitter of leaving it, far under the 5 s)."""
    folder = runs.dirs["profiled"] / "profile"
    traces = {}
    for rank in (0, 1):  # the spans only: what alignment reads (and a smaller file to merge)
        doc = load_trace(folder / f"rank{rank}.trace.json.gz")
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") == "user_annotation"]
        if rank == 1:
            doc["cumulus"] = {**doc.get("cumulus", {}), "host": "another-host"}
            doc["baseTimeNanoseconds"] = int(doc["baseTimeNanoseconds"]) + 5_000_000_000
        traces[rank] = tmp_path / f"rank{rank}.json"
        traces[rank].write_text(json.dumps(doc))
    lanes = phase_lanes(merge_traces(traces, tmp_path / "timeline.json.gz"))
    truth = phase_lanes(timeline)  # the run's own: one host, one clock
    assert len(lanes[1]["steps"]) == len(truth[1]["steps"]) == 2
    for (_, start, _), (_, want, _) in zip(lanes[1]["steps"], truth[1]["steps"]):
        assert abs(start - want) < 50_000  # µs


def test_hung_rank_is_named_and_the_job_ends(runs: Runs) -> None:
    """Rank 1 sleeps in step 3 past dist.timeout_s=20: rank 0 names it in one paragraph (the
    collective, the step, the dump), the job ends in under 2 minutes, the dumps are in
    RUN_DIR/hang/ (rank 1's with the stack it was stuck in), and the step-2 checkpoint
    evaluates."""
    proc, run_dir = runs.procs["hang"], runs.dirs["hang"]
    assert proc.returncode != 0
    assert runs.seconds < 120, runs.seconds
    paragraphs = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(paragraphs) == 1, explain(proc)
    text = paragraphs[0]
    assert text.startswith(f"error (rank 0): rank 1 (host {HOST}"), text
    assert "gloo:all_reduce" in text and "step 3" in text and "dist.timeout_s=20" in text
    # Both ranks' places in the phase clock's names: the hung one in its compute, the one
    # that waited in the gradient all-reduce in `sync`, as its timers and trace call it.
    assert "in step 3, phase compute)" in text, text
    assert "rank 0 entered in step 3, phase sync (gradient sync)" in text, text
    assert "step_00000002" in text
    stuck = json.loads((run_dir / "hang" / "rank1.json").read_text())
    assert any("profile_support.py" in frame for frame in stuck["stack"])
    seen = json.loads((run_dir / "hang" / "rank0.json").read_text())
    assert seen["verdict"]["missing"] == [1]
    assert [r["step"] for r in runs.records("hang")] == [1, 2]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_00000002"], ckpts


@pytest.mark.launches
def test_checkpoint_before_the_hang_evaluates(runs: Runs) -> None:
    # `trust=[tests]`: its saved config names the test's own callback.
    args = [
        f"checkpoint={runs.dirs['hang']}",
        "eval.max_batches=2",
        "trust=[tests]",
        "saved_paths=true",
    ]
    proc = run_cli(args, module="trainer.evaluate")
    assert proc.returncode == 0, explain(proc)
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert metrics["val/loss"] > 0
