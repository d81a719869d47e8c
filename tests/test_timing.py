"""Phase timing in one process: the clock's phases are exclusive and add up to the time they
span, the wait after the last gradient is its own phase, the slowest rank is named only by a
clear margin, and profiling settings are checked. Multi-rank behaviour: tests/test_profile.py.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.distributed import DistInfo
from engine.timing import PHASES, STEP_PHASES, WHEN_USED, PhaseClock, PhaseTimes
from tests.conftest import TINY, compose_config, train_in_process
from trainer.config.cli import to_config
from trainer.config.errors import ConfigError, UserError
from trainer.run.hang import CollectiveWatch
from trainer.tracking.phases import TABLE_FILE, PhaseTable, clearly_slowest
from trainer.tracking.profiler import build_profiler

CPU = torch.device("cpu")


def test_phases_are_exclusive_and_add_up() -> None:
    """Each phase gets at least the time slept in it, a collective nested in compute is
    `sync` and not compute, and the phases add up to no more than the wall time spanned."""
    clock = PhaseClock(CPU, enabled=True)
    outer = time.perf_counter()
    clock.begin_step(1)
    time.sleep(0.02)
    clock.switch("compute")
    time.sleep(0.01)
    with clock.collective("a count"):
        assert clock.waiting_in == "a count" and clock.phase == "sync"
        time.sleep(0.03)
    assert clock.phase == "compute" and clock.waiting_in is None and clock.seq == 1
    time.sleep(0.01)
    clock.switch("optimizer")
    time.sleep(0.005)
    clock.end_step()
    time.sleep(0.02)  # outside the step: not counted
    with clock.within("eval"):
        time.sleep(0.01)
    wall = time.perf_counter() - outer
    times = clock.collect()
    assert times is not None and times.steps == 1
    seconds = dict(zip(PHASES, times.seconds))
    for phase, slept in [("data", 0.02), ("compute", 0.02), ("sync", 0.03), ("optimizer", 0.005)]:
        assert seconds[phase] >= slept, (phase, seconds)
    assert seconds["eval"] >= 0.01 and seconds["checkpoint"] == 0.0
    assert sum(seconds.values()) <= wall - 0.02
    again = clock.collect()
    assert again is not None and sum(again.seconds) == 0.0 and again.steps == 0


def test_wait_after_backward_starts_once_every_gradient_is_computed() -> None:
    """The callback queued by `wait_after_backward` runs after the last gradient of the graph
    is accumulated (every parameter's hook sees the clock still in compute) and before
    backward returns; `after_backward` resumes compute."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    clock = PhaseClock(CPU, enabled=True)
    clock.switch("compute")
    seen: list[tuple[str | None, int]] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: seen.append((clock.phase, clock.seq)))
    loss = model(torch.randn(4, 8)).sum()
    clock.wait_after_backward(loss, "gradient sync")
    loss.backward()
    assert seen == [("compute", 0)] * 4
    assert clock.phase == "sync" and clock.waiting_in == "gradient sync" and clock.seq == 1
    clock.after_backward()
    assert clock.phase == "compute" and clock.waiting_in is None


def test_a_timed_out_collective_is_named_sync_as_the_timers_count_it() -> None:
    """A collective that times out (gloo's error, raised inside it) unwinds to the caller,
    where the hang watch reads the position: it names the wait `sync` and the collective, as
    the timers counted it and the trace labels it (`sync (NAME)`), not the compute phase the
    collective was entered from. The next step forgets it."""
    clock = PhaseClock(CPU, enabled=True)
    clock.begin_step(3)
    clock.switch("compute")
    with pytest.raises(RuntimeError, match="Timed out"), clock.collective("window item count"):
        time.sleep(0.05)
        raise RuntimeError("[gloo] Timed out waiting 20000ms for recv operation")
    times = clock.collect()
    assert times is not None
    seconds = dict(zip(PHASES, times.seconds))
    assert seconds["sync"] >= 0.05 > seconds["compute"]
    where = CollectiveWatch._where(clock)
    assert where == "in step 3, phase sync (window item count)", where
    clock.begin_step(4)
    assert CollectiveWatch._where(clock) == "in step 4, phase data"


def test_timing_off_measures_nothing_but_keeps_the_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUMULUS_PHASE_TIMING", "0")
    clock = PhaseClock(CPU)
    clock.begin_step(3)
    with clock.collective("x"):
        pass
    assert clock.collect() is None
    assert (clock.step, clock.seq, clock.phase) == (3, 1, "data")


def rows(data: list[float], compute: list[float], sync: float = 0.0) -> list[list[float]]:
    """Per-rank `PhaseTimes.as_list()` of one step."""
    out = []
    for d, c in zip(data, compute):
        seconds = dict.fromkeys(PHASES, 0.0) | {"data": d, "compute": c, "sync": sync}
        out.append(PhaseTimes([seconds[p] for p in PHASES], 1).as_list())
    return out


def test_slowest_rank_by_a_clear_margin() -> None:
    assert clearly_slowest([0.01, 0.24]) == 1
    assert clearly_slowest([0.10, 0.12]) is None  # within the margin
    assert clearly_slowest([0.001, 0.005]) is None  # a few ms: noise, not a rank
    assert clearly_slowest([0.05, 0.05, 0.3, 0.05]) == 2
    assert clearly_slowest([0.3]) is None


def test_straggler_line_after_a_streak(tmp_path: Path) -> None:
    """Rank 2 slowest in data in three records in a row: one line naming it, its host and
    the input; the keys name the slowest rank with its time, the median and the fastest;
    `sync` (where the fast ranks wait) is never blamed; the table is written."""
    stream = io.StringIO()
    table = PhaseTable(DistInfo(0, 4, 0, CPU), tmp_path, stream)
    table.hosts = ["a", "b", "c", "d"]
    slow_data = rows([0.01, 0.01, 0.3, 0.01], [0.1] * 4, sync=0.5)
    keys = table.record(slow_data)
    assert keys["time/data_s"] == 0.3 and keys["time/data_rank"] == 2
    assert keys["time/data_median_s"] == 0.01 and keys["time/data_min_s"] == 0.01
    assert keys["time/compute_rank"] == 0  # a tie: the lowest rank
    assert "time/eval_s" not in keys  # no evaluation since the last record
    table.record(slow_data)
    assert stream.getvalue() == ""
    table.record(slow_data)
    table.record(slow_data)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert (
        lines[0].startswith("slowest rank 2 (c): data 0.30 s vs median 0.01 s")
        and "input" in lines[0]
    )
    saved = json.loads((tmp_path / TABLE_FILE).read_text())
    assert saved["records"] == 4
    assert saved["ranks"][2]["slowest_records"]["data"] == 4  # clearly, each time
    assert saved["ranks"][0]["slowest_records"]["compute"] == 0  # a tie is not clear
    assert saved["ranks"][2]["mean_s"]["data"] == pytest.approx(0.3)


def test_a_broken_streak_is_not_named() -> None:
    stream = io.StringIO()
    table = PhaseTable(DistInfo(0, 2, 0, CPU), None, stream)
    for slow in (1, 1, 0, 1, 1, 0):
        compute = [0.5 if r == slow else 0.05 for r in range(2)]
        table.record(rows([0.0, 0.0], compute))
    assert stream.getvalue() == ""


def test_one_process_records_phase_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run on one process: every training record has the four phases' time and rank
    (rank 0), and no median or minimum (one rank has none to give). The device is given a
    peak FLOP/s, as a known GPU has: the record's MFU and its phase times come together (the
    MFU's arithmetic once overwrote the ranks' times, and every CUDA run on an H100 or H200
    died at its first record).

    Evaluations and checkpoints every 2 steps of 3: those of step 2 are in step 3's record
    (done between the two records); the final evaluation and checkpoint (step 3), after the
    last record, are in time_by_rank.json's `final` and the summary, and the table's totals
    are the records' and the final ones' together (they were lost)."""
    monkeypatch.setattr("trainer.tracking.records.device_peak_flops", lambda device: 1e12)
    every = ["eval.every_steps=2", "eval.max_batches=2", "checkpoint.every_steps=2"]
    on = train_in_process([*TINY, "train.max_steps=3", *every], tmp_path / "on")
    train = [r for r in on if "train/loss" in r]
    assert len(train) == 3
    for record in train:
        assert record["train/mfu"] > 0
        assert not any(f"time/{phase}_s" in record for phase in WHEN_USED)  # no rollouts
        for phase in (p for p in STEP_PHASES if p not in WHEN_USED):
            assert record[f"time/{phase}_rank"] == 0
            assert record[f"time/{phase}_s"] >= 0.0
        assert not any(k.endswith("_median_s") for k in record)
    assert [r["step"] for r in train if "time/eval_s" in r] == [3]
    assert [r["step"] for r in train if "time/checkpoint_s" in r] == [3]
    table = json.loads((tmp_path / "on" / TABLE_FILE).read_text())
    final = table["final"]
    assert final["eval_s"] > 0 and final["checkpoint_s"] > 0
    assert final["eval_rank"] == final["checkpoint_rank"] == 0
    (rank,) = table["ranks"]
    for phase in ("eval", "checkpoint"):
        total = train[2][f"time/{phase}_s"] + final[f"{phase}_s"]
        assert rank["total_s"][phase] == pytest.approx(total, rel=1e-9), phase
    summary = (tmp_path / "on" / "summary.txt").read_text()
    shown = f"evaluation {final['eval_s']:.2f} s (rank 0), checkpoint {final['checkpoint_s']:.2f} s"
    assert f"  after the last record: {shown} (rank 0) ({TABLE_FILE} `final`)" in summary, summary


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("profile.steps=[4,3]", "profile.steps"),
        ("profile.steps=[0,2]", "profile.steps"),
        ("profile.steps=[2]", "profile.steps"),
        ("profile.ranks=[-1]", "profile.ranks"),
        ("profile.kind=nsys", "profile"),
    ],
)
def test_bad_profile_settings_name_their_key(override: str, key: str) -> None:
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        to_config(compose_config(["profile=torch", override]))


def test_a_profile_window_after_the_last_step_is_refused() -> None:
    """`profile.steps` that start after `train.max_steps` would trace nothing (the run exited 0
    with an empty profile/): refused with the config, naming both keys. Without profile=torch
    the window is not read."""
    bad = ["profile=torch", "profile.steps=[11,12]", "train.max_steps=10"]
    with pytest.raises(ConfigError, match=r"`profile\.steps`.*train\.max_steps=10"):
        to_config(compose_config(bad))
    to_config(compose_config(bad[1:]))


def test_a_profile_window_past_the_last_step_is_clipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A window that starts inside the run and ends after it (steps 2-5 of 2) is clipped at
    the last step, said at start-up: the trace of step 2 is written and the summary names
    steps 2-2."""
    train_in_process([*TINY, "train.max_steps=2", "profile=torch", "profile.steps=[2,5]"], tmp_path)
    out = capsys.readouterr().out
    assert "profile.steps=[2, 5] ends after the run's last step (train.max_steps=2)" in out, out
    assert (tmp_path / "profile" / "rank0.trace.json.gz").is_file()
    assert "profile: steps 2-2 of rank(s) 0" in (tmp_path / "summary.txt").read_text()


def test_profiled_rank_outside_the_world_is_refused(tmp_path: Path) -> None:
    cfg, _ = to_config(compose_config(["profile=torch", "profile.ranks=[0,2]"]))
    with pytest.raises(ConfigError, match=r"profile\.ranks.*rank\(s\) 2 do not exist"):
        build_profiler(cfg.profile, tmp_path, DistInfo(0, 2, 0, CPU), PhaseClock(CPU))
