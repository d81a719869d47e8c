"""Pipeline parallelism (`dist.pp`): schedules, stage splits, exactness, resume, fp16, refusals.

The schedules and the split are data, so they are checked directly (every rank's list
together covers each forward and backward exactly once and runs without deadlock in
`simulate`; the balanced split is checked against brute force). Everything else goes through
the command (`python -m trainer.train`, torchrun with gloo on CPU; warm ranks, tests/ranks.py)
and is compared with an independent reference: the same configuration on one process without
a pipeline, which never touches engine/parallel/pipeline/. Runs that several tests read are
launched once per module, all at once (`launch_all`).
"""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.parallel.pipeline import NotSplittable, stage_ranges
from engine.parallel.pipeline.schedule import SCHEDULES, Action, actions, simulate
from tests.conftest import read_metrics, train_records
from tests.pipeline_support import OverflowGPT
from tests.ranks import explain, launch, launch_all, torchrun_cmd
from tests.test_checkpoint import kill_at, resumed_steps
from trainer.config.cli import EXIT_USER_ERROR

Records = list[dict[str, Any]]

# gpt_tiny with 4 blocks (2 per stage, 1 per stage with pp_virtual=2), short sequences.
BASE = [
    "model=gpt_tiny",
    "logger=none",
    "model.n_layer=4",
    "data.block_size=32",
    "train.micro_batch_size=4",
    "train.max_steps=6",
    "train.log_every=1",
    "eval.every_steps=3",
    "eval.max_batches=2",
    "scheduler.warmup_steps=2",
    "checkpoint.every_steps=0",
]
ACCUM8 = [*BASE, "train.grad_accum_steps=8"]  # global batch 32 on one data-parallel replica
# Checkpoints at 2, 4, 6, all kept: a resume can start at step 2 or 4.
CKPT = ["checkpoint.every_steps=2", "checkpoint.keep_last=3"]
PP2 = ["dist.pp=2"]
INTERLEAVED = ["dist.pp=2", "dist.pp_schedule=interleaved_1f1b", "dist.pp_virtual=2"]
UNPACKED = ["data.packed=false"]  # variable-length documents, padded per micro-batch
# fp16 + GradScaler; block 0's 12th training forward (step 2, micro-batch 4 of 8) overflows.
OVERFLOW_CALL = 12
OVERFLOW_STEP = 2
FP16 = [
    *ACCUM8,
    "train.max_steps=4",
    "train.precision=fp16",
    "model._target_=tests.pipeline_support.OverflowGPT",
    f"+model.overflow_at_call={OVERFLOW_CALL}",
]
STEPS = list(range(1, 7))
TRAIN_KEYS = ("train/loss", "train/grad_norm")
ATOL = 1e-5
TIMEOUT = 420.0  # everything of a batch at once on 2 cores; alone, a 2-rank run takes ~10 s
TRACEBACK = "Traceback (most recent call last)"


def python(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "trainer.train", *args]


def torchrun(nproc: int, args: Sequence[str], *launcher: str) -> list[str]:
    return [*torchrun_cmd(nproc, *launcher), "-m", "trainer.train", *args]


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, explain(proc)


def val_records(records: Records) -> Records:
    return [r for r in records if "val/loss" in r]


def by_step(records: Records, keys: Sequence[str]) -> dict[int, tuple]:
    """The last record of each step wins (a resumed run appends redone steps again)."""
    return {r["step"]: tuple(r.get(k) for k in keys) for r in records}


def assert_close(
    got: Records,
    want: Records,
    keys: Sequence[str],
    steps: Sequence[int],
    atol: float = ATOL,
    rtol: float = 0.0,
) -> None:
    """`keys` of `got` and `want` agree within `atol + rtol * |want|` at exactly `steps`."""
    g, w = by_step(got, keys), by_step(want, keys)
    assert sorted(g) == sorted(w) == list(steps), (sorted(g), sorted(w), list(steps))
    bad = []
    for s in steps:
        for k, x, y in zip(keys, g[s], w[s]):
            if x is None or y is None:
                if x is not y:
                    bad.append((s, k, x, y))
            elif not abs(x - y) <= atol + rtol * abs(y):
                bad.append((s, k, x, y, abs(x - y)))
    assert not bad, f"{len(bad)} value(s) differ from the reference: {bad[:6]}"


def assert_equal(got: Records, want: Records, keys: Sequence[str]) -> None:
    """Bitwise (`==` on full-precision JSON floats) at every step, and the same steps."""
    g, w = by_step(got, keys), by_step(want, keys)
    assert sorted(g) == sorted(w), (sorted(g), sorted(w))
    diffs = [(s, g[s], w[s]) for s in sorted(w) if g[s] != w[s]]
    assert not diffs, f"{len(diffs)} step(s) differ from the uninterrupted run: {diffs[:4]}"


# =========================================================================== 1. schedules


def schedule_cases() -> list[tuple[str, int, int, int]]:
    """(schedule, pp, n_micro, virtual): every plain schedule at pp 2..4 and 1..8 micro-batches;
    interleaved at virtual 2 and 3 with micro-batch counts that are multiples of pp."""
    cases = []
    for pp, n_micro in itertools.product((2, 3, 4), (1, 2, 4, 8)):
        cases += [("gpipe", pp, n_micro, 1), ("1f1b", pp, n_micro, 1)]
    for pp, virtual, k in itertools.product((2, 3, 4), (2, 3), (1, 2, 3)):
        cases.append(("interleaved_1f1b", pp, pp * k, virtual))
    return cases


@pytest.mark.parametrize(("schedule", "pp", "n_micro", "virtual"), schedule_cases())
def test_schedule_covers_every_action_once_and_runs(
    schedule: str, pp: int, n_micro: int, virtual: int
) -> None:
    """Every (F/B, stage, micro) of the window appears exactly once over all ranks, each on
    the rank holding its stage (stage % pp), and the lists run without deadlock."""
    n_stages = pp * virtual
    lists = [actions(schedule, pp, r, n_micro, virtual) for r in range(pp)]
    for r, acts in enumerate(lists):
        assert all(a.stage % pp == r for a in acts), (r, acts)
        assert all(a.kind in ("F", "B") for a in acts), acts
    flat = [a for acts in lists for a in acts]
    want = {Action(k, s, m) for k in ("F", "B") for s in range(n_stages) for m in range(n_micro)}
    assert len(flat) == len(want) and set(flat) == want
    rounds = simulate(lists, n_stages)
    # Every stage's forward and backward of one micro-batch are sequential: a lower bound.
    assert rounds >= 2 * n_stages


def test_one_f_one_b_bounds_live_activations() -> None:
    """1F1B's point over GPipe: rank r holds at most pp - r micro-batches' activations."""
    pp, n_micro = 4, 8
    for r in range(pp):
        live, peak = 0, 0
        for a in actions("1f1b", pp, r, n_micro):
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(pp - r, n_micro), (r, peak)
    gpipe_peak = sum(a.kind == "F" for a in actions("gpipe", pp, 0, n_micro))
    assert gpipe_peak == n_micro


def test_simulate_rejects_a_backward_before_its_forward() -> None:
    """A rank whose own backward precedes its forward can never run it."""
    good = [actions("1f1b", 2, r, 2) for r in range(2)]
    broken = [list(good[0]), list(good[1])]
    f, b = broken[1].index(Action("F", 1, 0)), broken[1].index(Action("B", 1, 0))
    broken[1][f], broken[1][b] = broken[1][b], broken[1][f]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(broken, 2)


def test_simulate_rejects_two_ranks_waiting_on_each_other() -> None:
    """Rank 0 waits for stage 1's backward of micro 0 before sending micro 1's forward; rank 1
    needs micro 1's forward before it runs micro 0's backward: a cycle."""
    lists = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
        [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)],
    ]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(lists, 2)
    # The same actions in a consistent order run (the failure above is the order's).
    lists[1] = [Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1)]
    simulate(lists, 2)


def test_simulate_rejects_a_missing_or_repeated_action() -> None:
    """A lost forward leaves its successors waiting; a repeated one is reported."""
    lists = [actions("gpipe", 2, r, 2) for r in range(2)]
    missing = [[a for a in lists[0] if a != Action("F", 0, 1)], lists[1]]
    with pytest.raises(RuntimeError):
        simulate(missing, 2)
    repeated = [[*lists[0][:1], *lists[0]], lists[1]]
    with pytest.raises(RuntimeError, match="twice"):
        simulate(repeated, 2)


@pytest.mark.parametrize(("pp", "n_micro"), [(2, 3), (3, 4), (4, 6), (4, 2)])
def test_interleaved_needs_a_multiple_of_pp(pp: int, n_micro: int) -> None:
    with pytest.raises(ValueError, match="multiple"):
        actions("interleaved_1f1b", pp, 0, n_micro, 2)


def test_unknown_schedule_and_virtual_on_plain_schedules_raise() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        actions("zero_bubble", 2, 0, 4)
    for schedule in ("gpipe", "1f1b"):
        with pytest.raises(ValueError, match="pp_virtual"):
            actions(schedule, 2, 0, 4, 2)
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b"}


# =========================================================================== 1b. stage ranges


def brute_force_best(sizes: Sequence[int], n_stages: int) -> int:
    """The smallest possible largest-stage sum over all contiguous splits."""
    best = math.inf
    for cuts in itertools.combinations(range(1, len(sizes)), n_stages - 1):
        bounds = [0, *cuts, len(sizes)]
        best = min(best, max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)))
    return int(best)


def assert_partition(ranges: list[range], n_blocks: int, n_stages: int) -> None:
    assert len(ranges) == n_stages
    assert all(len(r) >= 1 and r.step == 1 for r in ranges), ranges
    assert [i for r in ranges for i in r] == list(range(n_blocks)), ranges


@pytest.mark.parametrize(
    "sizes",
    [
        [5] * 4,
        [5] * 6,
        [7] * 8,
        [10, 1, 1, 1, 1, 10],
        [1, 1, 1, 1, 1, 30],
        [30, 1, 1, 1, 1, 1],
        [3, 9, 2, 7, 7, 1, 4],
        [1, 2, 3, 4, 5, 6, 7, 8],
    ],
)
def test_balanced_split_is_optimal(sizes: list[int]) -> None:
    """For every stage count the largest stage's size is the brute-force minimum."""
    for n_stages in range(1, len(sizes) + 1):
        ranges = stage_ranges(sizes, n_stages, None)
        assert_partition(ranges, len(sizes), n_stages)
        largest = max(sum(sizes[i] for i in r) for r in ranges)
        assert largest == brute_force_best(sizes, n_stages), (n_stages, ranges)


def test_equal_blocks_split_evenly() -> None:
    assert stage_ranges([4] * 4, 2, None) == [range(0, 2), range(2, 4)]
    assert stage_ranges([4] * 6, 3, None) == [range(0, 2), range(2, 4), range(4, 6)]
    assert stage_ranges([4] * 4, 4, None) == [range(i, i + 1) for i in range(4)]


def test_explicit_split() -> None:
    assert stage_ranges([1] * 6, 3, [1, 5]) == [range(0, 1), range(1, 5), range(5, 6)]
    assert stage_ranges([1, 100], 2, [1]) == [range(0, 1), range(1, 2)]


@pytest.mark.parametrize(
    ("sizes", "n_stages", "split", "match"),
    [
        ([1, 1], 3, None, "cannot fill"),
        ([1, 1, 1, 1], 3, [2, 2], "increasing"),
        ([1, 1, 1, 1], 3, [3, 2], "increasing"),
        ([1, 1, 1, 1], 2, [0], "increasing"),
        ([1, 1, 1, 1], 3, [2], "increasing"),
        ([1, 1, 1, 1], 2, [4], "blocks"),
    ],
)
def test_split_errors(sizes: list[int], n_stages: int, split: list[int] | None, match: str) -> None:
    with pytest.raises(NotSplittable, match=match):
        stage_ranges(sizes, n_stages, split)


# =========================================================================== 1c. the fp16 probe


def test_overflow_probe_routes_through_a_pipeline_stage() -> None:
    """`OverflowGPT`'s injection survives `GPT.pipeline_stage`'s shallow copy: the stage's own
    forward counts training calls (not eval ones) and poisons the Nth, and only block 0's
    `ln1.weight` (stage 0's) gets an inf gradient; the hidden state sent on stays finite."""
    torch.manual_seed(0)
    model = OverflowGPT(overflow_at_call=2, n_layer=4, n_embd=32, n_head=2, block_size=32)
    stage = model.pipeline_stage([0, 1], first=True, last=False)
    assert type(stage) is OverflowGPT and stage.blocks[0] is model.blocks[0]
    idx = torch.randint(0, 256, (2, 8))
    stage.eval()
    with torch.no_grad():
        stage(idx)
    stage.train()
    for call in (1, 2):
        model.zero_grad(set_to_none=True)
        hidden = torch.randn(2, 8, 32)
        out = stage(idx)
        assert out.shape == (2, 8, 32)  # hidden states, not logits: a first, not last stage
        out.backward(hidden)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads and "blocks.2.ln1.weight" not in grads  # block 2 is another stage's
        inf = sorted(n for n, g in grads.items() if not torch.isfinite(g).all())
        assert inf == (["blocks.0.ln1.weight"] if call == 2 else []), (call, inf)
        assert torch.isfinite(out).all()
    assert model.training_calls == 2 and model.poisoned_calls == [2]


# =========================================================================== shared runs


class Runs:
    """Launches named commands (all of a batch at once) and keeps their run dirs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.CompletedProcess] = {}

    def dir(self, name: str) -> Path:
        return self.root / name

    def launch(self, cmds: dict[str, list[str]]) -> None:
        todo = {n: [*c, f"hydra.run.dir={self.dir(n)}"] for n, c in cmds.items()}
        self.procs.update(launch_all(todo, TIMEOUT, TMPDIR=str(self.root)))
        for name in cmds:
            ok(self.procs[name])

    def records(self, name: str) -> Records:
        return read_metrics(self.dir(name))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The one-process references and the pipelined runs compared with them."""
    r = Runs(tmp_path_factory.mktemp("pp_runs"))
    r.launch(
        {
            "ref": python([*ACCUM8, *CKPT]),
            "ref_unpacked": python([*ACCUM8, *UNPACKED]),
            "gpipe": torchrun(2, [*ACCUM8, *PP2, "dist.pp_schedule=gpipe"]),
            # Also the uninterrupted run the kill -9 test resumes to (checkpoints change
            # nothing in the trajectory).
            "1f1b": torchrun(2, [*ACCUM8, *PP2, *CKPT, "dist.pp_schedule=1f1b"]),
            "interleaved": torchrun(2, [*ACCUM8, *INTERLEAVED]),
            "interleaved_unpacked": torchrun(2, [*ACCUM8, *INTERLEAVED, *UNPACKED]),
            "gpipe_unpacked": torchrun(2, [*ACCUM8, *UNPACKED, *PP2, "dist.pp_schedule=gpipe"]),
            # 2 stages x 2 data-parallel replicas x micro 4 x accum 4: the same global batch.
            "pp2_dp2": torchrun(4, [*BASE, "train.grad_accum_steps=4", *PP2]),
            # The same with each stage FSDP2-sharded over its 2 data-parallel ranks.
            "pp2_fsdp2": torchrun(
                4, [*BASE, *CKPT, "train.grad_accum_steps=4", *PP2, "dist.strategy=fsdp"]
            ),
            "fp16_ref": python(FP16),
            "fp16_pp2": torchrun(2, [*FP16, *PP2]),
        }
    )
    return r


def check_against(got: Records, want: Records) -> None:
    """Train loss and grad norm every step, validation loss at 3 and 6, within 1e-5."""
    assert_close(train_records(got), train_records(want), TRAIN_KEYS, STEPS)
    assert_close(val_records(got), val_records(want), ("val/loss",), [3, 6])


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_two_stages_train_like_one_process(runs: Runs, name: str) -> None:
    """Each schedule on 2 ranks (interleaved: 4 stages, 2 per rank) logs the one-process
    run's loss, gradient norm and validation loss: the window's normalization, the tied
    embedding's summed gradient and the norm over all stages are exact."""
    check_against(runs.records(name), runs.records("ref"))
    assert runs.records(name)[0]["train/lr"] == runs.records("ref")[0]["train/lr"]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["interleaved_unpacked", "gpipe_unpacked"])
def test_unpacked_documents_train_like_one_process(runs: Runs, name: str) -> None:
    """Variable-length micro-batches (each padded to its own length) travel between stages
    with their shapes, and padding is left out of the loss as on one process."""
    check_against(runs.records(name), runs.records("ref_unpacked"))
    # Not vacuous: the unpacked data gives another trajectory than the packed one.
    a, b = train_records(runs.records("ref_unpacked")), train_records(runs.records("ref"))
    assert abs(a[0]["train/loss"] - b[0]["train/loss"]) > 1e-3


@pytest.mark.multiproc
def test_pipeline_times_data_parallel_trains_like_one_process(runs: Runs) -> None:
    """4 ranks: 2 stages x 2 data-parallel replicas of accum 4 (global batch 32 again)."""
    check_against(runs.records("pp2_dp2"), runs.records("ref"))


@pytest.mark.multiproc
def test_fsdp_stages_train_like_one_process(runs: Runs) -> None:
    """4 ranks: 2 stages, each FSDP2-sharded over 2 data-parallel ranks: gradients are
    reduce-scattered as sums in each stage's last backward, the tied embedding's shards are
    summed across the stages, the norm adds the shards' squares."""
    check_against(runs.records("pp2_fsdp2"), runs.records("ref"))


@pytest.mark.multiproc
def test_reference_is_not_trivially_matched(runs: Runs) -> None:
    """Negative control: the loss moves by far more than the tolerance over the run, so
    agreeing with the reference at every step is not agreeing with a constant."""
    losses = [r["train/loss"] for r in train_records(runs.records("ref"))]
    assert max(losses) - min(losses) > 1000 * ATOL


# =========================================================================== 4. fp16 overflow


@pytest.mark.multiproc
def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(runs: Runs) -> None:
    """Block 0 (stage 0, rank 0) alone gets an inf gradient at step 2. The GradScaler skips
    that step on both stages: the loss scale halves there and only there, the step counts as
    skipped, and the next step's loss is the one-process run's, which also skipped it. Had
    stage 1 stepped while stage 0 did not, step 3's loss would be another."""
    got, want = train_records(runs.records("fp16_pp2")), train_records(runs.records("fp16_ref"))
    steps = [1, 2, 3, 4]
    scales = [r["train/loss_scale"] for r in got]
    assert scales[0] > 0
    assert scales == [scales[0], scales[0] / 2, scales[0] / 2, scales[0] / 2], scales
    assert [r["train/skipped_steps"] for r in got] == [0, 1, 1, 1]
    assert_equal(got, want, ("train/loss_scale", "train/skipped_steps"))
    # The skipped step logs no gradient norm (it is not finite), on both.
    assert got[OVERFLOW_STEP - 1]["train/grad_norm"] is None
    assert want[OVERFLOW_STEP - 1]["train/grad_norm"] is None
    assert_close(got, want, ("train/loss",), steps)
    # fp16 rounding differs with the order of the work: the norm agrees to 1e-4 relative.
    assert_close(got, want, ("train/grad_norm",), steps, atol=0.0, rtol=1e-4)
    assert_close(
        val_records(runs.records("fp16_pp2")),
        val_records(runs.records("fp16_ref")),
        ("val/loss",),
        [3, 4],
    )


# =========================================================================== 3. resume


def checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    assert path.is_dir(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    return path


@pytest.mark.multiproc
@pytest.mark.parametrize("rank", [0, 1])
def test_sigkill_then_rerun_continues_bit_for_bit(runs: Runs, tmp_path: Path, rank: int) -> None:
    """A pipelined run SIGKILLed on one rank after step 5 (checkpoints at 2 and 4), rerun with
    the same command, resumes at step 4 and logs the uninterrupted run's records exactly."""
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    args = [*ACCUM8, *PP2, *CKPT, "dist.pp_schedule=1f1b", f"hydra.run.dir={run_dir}"]
    args += kill_at(5, marker, rank)
    assert_killed_run_continues(args, run_dir, marker, tmp_path, runs.records("1f1b"))


def assert_killed_run_continues(
    args: list[str], run_dir: Path, marker: Path, tmp_path: Path, want: list[dict]
) -> None:
    """`args` SIGKILL one rank after step 5 (`kill_at`): it dies before the step-6 checkpoint;
    the same command again resumes at step 4 and logs `want`'s records exactly."""
    first = launch(torchrun(2, args), TIMEOUT, tmp=tmp_path)
    assert first.returncode != 0 and marker.exists(), explain(first)
    assert not (run_dir / "checkpoints" / "step_00000006").exists()
    rerun = launch(torchrun(2, args), TIMEOUT, tmp=tmp_path)
    ok(rerun)
    assert resumed_steps(rerun) == [4], explain(rerun)
    got = read_metrics(run_dir)
    assert [r["step"] for r in train_records(got)] == STEPS
    assert_equal(train_records(got), train_records(want), TRAIN_KEYS)
    assert_equal(val_records(got), val_records(want), ("val/loss",))


@pytest.mark.multiproc
def test_checkpoints_move_between_pipelined_and_single_process(runs: Runs, tmp_path: Path) -> None:
    """The pipelined run's step-2 checkpoint resumed on one process, and the one-process
    run's step-2 checkpoint resumed on 4 interleaved stages over 2 ranks, both continue the
    uninterrupted trajectory (steps 3..6, validation at 3 and 6) within 1e-5."""
    to_single, to_pp = tmp_path / "to_single", tmp_path / "to_pp"
    from_fsdp = tmp_path / "from_fsdp"
    procs = launch_all(
        {
            "from_fsdp": python(
                [
                    *ACCUM8,
                    f"checkpoint.resume={checkpoint(runs.dir('pp2_fsdp2'), 2)}",
                    f"hydra.run.dir={from_fsdp}",
                ]
            ),
            "to_single": python(
                [
                    *ACCUM8,
                    f"checkpoint.resume={checkpoint(runs.dir('1f1b'), 2)}",
                    f"hydra.run.dir={to_single}",
                ]
            ),
            "to_pp": torchrun(
                2,
                [
                    *ACCUM8,
                    *INTERLEAVED,
                    f"checkpoint.resume={checkpoint(runs.dir('ref'), 2)}",
                    f"hydra.run.dir={to_pp}",
                ],
            ),
        },
        TIMEOUT,
        TMPDIR=str(tmp_path),
    )
    cases = (
        ("to_single", to_single, "1f1b"),
        ("to_pp", to_pp, "ref"),
        ("from_fsdp", from_fsdp, "ref"),  # FSDP-sharded stages: `auto` wrote them sharded
    )
    for name, run_dir, source in cases:
        ok(procs[name])
        assert resumed_steps(procs[name]) == [2], explain(procs[name])
        got, want = read_metrics(run_dir), runs.records(source)
        rest = [s for s in STEPS if s > 2]
        assert_close(
            [r for r in train_records(got) if r["step"] > 2],
            [r for r in train_records(want) if r["step"] > 2],
            TRAIN_KEYS,
            rest,
        )
        assert_close(val_records(got), val_records(want), ("val/loss",), [3, 6])


@pytest.mark.multiproc
def test_pipelined_checkpoint_holds_the_whole_model(runs: Runs) -> None:
    """The step-6 checkpoint of the 2-stage run (gathered from both ranks) matches the
    one-process run's parameter for parameter, under the model's own names."""
    a = checkpoint(runs.dir("1f1b"), 6)
    b = checkpoint(runs.dir("ref"), 6)
    # Per-rank files (RNG streams) may differ with the world size; the model is in state.pt.
    assert (a / "state.pt").is_file() and (b / "state.pt").is_file()
    sa = torch.load(a / "state.pt", map_location="cpu", weights_only=False)
    sb = torch.load(b / "state.pt", map_location="cpu", weights_only=False)
    ma, mb = find_model_state(sa), find_model_state(sb)
    assert sorted(ma) == sorted(mb) and "blocks.3.mlp.fc.weight" in ma
    worst = max((ma[k].float() - mb[k].float()).abs().max().item() for k in mb)
    assert worst <= 1e-5, worst


def find_model_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's state dict inside a checkpoint file (the entry with `tok_emb.weight`)."""
    if "tok_emb.weight" in state:
        return state
    for v in state.values():
        if isinstance(v, dict):
            found = find_model_state(v)
            if found:
                return found
    return {}


# =========================================================================== 3b. sharded (DCP)

SHARDED = ["checkpoint.format=sharded"]
PP2_SHARDED = [*ACCUM8, *PP2, *CKPT, *SHARDED, "dist.pp_schedule=1f1b"]
# 2 data-parallel ranks x micro 4 x accum 4 (global batch 32), FSDP2: `auto` is sharded.
FSDP2 = [*BASE, *CKPT, "train.grad_accum_steps=4", "dist.strategy=fsdp"]


@pytest.fixture(scope="module")
def dcp_runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Uninterrupted runs writing sharded checkpoints at steps 2, 4, 6: 2 pipeline stages, 2
    FSDP ranks without a pipeline, and one process writing the old nested optimizer layout."""
    r = Runs(tmp_path_factory.mktemp("pp_dcp_runs"))
    r.launch(
        {
            "pp2": torchrun(2, PP2_SHARDED),
            "fsdp2": torchrun(2, FSDP2),
            "nested": [sys.executable, "-m", "tests.old_dcp_layout", *ACCUM8, *CKPT, *SHARDED],
        }
    )
    return r


def optimizer_layout_of(ckpt: Path) -> str:
    from engine.checkpoint.sharded import optimizer_layout

    assert (ckpt / "shards" / ".metadata").is_file(), sorted(p.name for p in ckpt.iterdir())
    return optimizer_layout(ckpt / "shards")


@pytest.mark.multiproc
def test_sharded_sigkill_then_rerun_continues_bit_for_bit(dcp_runs: Runs, tmp_path: Path) -> None:
    """2 stages writing sharded checkpoints, each stage its own parameters (the tied embedding
    on both), SIGKILLed on rank 1 after step 5: the rerun resumes at step 4 and logs the
    uninterrupted run's records exactly."""
    run_dir, marker = tmp_path / "run", tmp_path / "killed"
    args = [*PP2_SHARDED, f"hydra.run.dir={run_dir}", *kill_at(5, marker, 1)]
    assert_killed_run_continues(args, run_dir, marker, tmp_path, dcp_runs.records("pp2"))
    assert optimizer_layout_of(checkpoint(run_dir, 4)) == "grouped"


# name: (command without resume and run dir, the run whose step-2 checkpoint it resumes)
DCP_RESUMES = {
    "pp2_to_single": (python(ACCUM8), "pp2"),
    "fsdp2_to_pp2": (torchrun(2, [*ACCUM8, *PP2]), "fsdp2"),
    "nested_to_pp2": (torchrun(2, [*ACCUM8, *PP2]), "nested"),
}


@pytest.fixture(scope="module")
def dcp_resumes(
    dcp_runs: Runs, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Each of `DCP_RESUMES` launched once (all at once): (process, run dir)."""
    root = tmp_path_factory.mktemp("pp_dcp_resumes")
    cmds = {
        name: [
            *cmd,
            f"checkpoint.resume={checkpoint(dcp_runs.dir(source), 2)}",
            f"hydra.run.dir={root / name}",
        ]
        for name, (cmd, source) in DCP_RESUMES.items()
    }
    procs = launch_all(cmds, TIMEOUT, TMPDIR=str(root))
    return {name: (procs[name], root / name) for name in cmds}


def check_resumed_at_2(
    dcp_resumes: dict[str, tuple[subprocess.CompletedProcess, Path]], dcp_runs: Runs, name: str
) -> None:
    """Resumed at step 2, the run continues its source's trajectory (steps 3..6, validation
    at 3 and 6) within 1e-5."""
    proc, run_dir = dcp_resumes[name]
    ok(proc)
    assert resumed_steps(proc) == [2], explain(proc)
    got, want = read_metrics(run_dir), dcp_runs.records(DCP_RESUMES[name][1])
    assert_close(
        [r for r in train_records(got) if r["step"] > 2],
        [r for r in train_records(want) if r["step"] > 2],
        TRAIN_KEYS,
        [s for s in STEPS if s > 2],
    )
    assert_close(val_records(got), val_records(want), ("val/loss",), [3, 6])


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["pp2_to_single", "fsdp2_to_pp2"])
def test_sharded_checkpoints_move_between_pipelined_and_not(
    dcp_resumes: dict[str, tuple[subprocess.CompletedProcess, Path]], dcp_runs: Runs, name: str
) -> None:
    """The 2-stage run's step-2 sharded checkpoint resumed on one process, and the 2-rank FSDP
    run's on 2 stages (1 data-parallel rank): DCP reads each rank's parameters by name."""
    assert optimizer_layout_of(checkpoint(dcp_runs.dir(DCP_RESUMES[name][1]), 2)) == "grouped"
    check_resumed_at_2(dcp_resumes, dcp_runs, name)


@pytest.mark.multiproc
def test_old_nested_sharded_checkpoint_resumes_on_stages(
    dcp_resumes: dict[str, tuple[subprocess.CompletedProcess, Path]], dcp_runs: Runs
) -> None:
    """A sharded checkpoint of the old nested optimizer layout (parameter groups keyed by
    index, written by the old code on one process) resumes on 2 stages: its groups name
    every parameter, and each stage takes its own."""
    assert optimizer_layout_of(checkpoint(dcp_runs.dir("nested"), 2)) == "nested"
    check_resumed_at_2(dcp_resumes, dcp_runs, "nested_to_pp2")


# =========================================================================== 5. refusals


REFUSE_BASE = ["model=gpt_tiny", "logger=none", "train.max_steps=2", "eval.every_steps=0"]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Each refused configuration, launched once (all at once)."""
    root = tmp_path_factory.mktemp("pp_refusals")
    cmds = {
        "one_process": python([*REFUSE_BASE, *PP2]),
        "noise_scale": torchrun(2, [*REFUSE_BASE, *PP2, "callbacks=noise_scale"]),
        "virtual_1f1b": python([*REFUSE_BASE, *PP2, "dist.pp_virtual=2"]),
        "no_stages": torchrun(2, ["experiment=digits", "logger=none", "train.max_steps=2", *PP2]),
        "sam": torchrun(2, [*REFUSE_BASE, *PP2, "step=sam"]),
        "accum_not_multiple": torchrun(
            2, [*REFUSE_BASE, "model.n_layer=4", "train.grad_accum_steps=3", *INTERLEAVED]
        ),
    }
    cmds = {n: [*c, f"hydra.run.dir={root / n}"] for n, c in cmds.items()}
    return launch_all(cmds, TIMEOUT, TMPDIR=str(root))


def error_lines(proc: subprocess.CompletedProcess) -> str:
    return "\n".join(line for line in proc.stderr.splitlines() if line.startswith("error:"))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("name", "key", "hints"),
    [
        ("one_process", "dist.pp", ("torchrun", "--nproc_per_node=2")),
        ("virtual_1f1b", "dist.pp_virtual", ("interleaved_1f1b",)),
    ],
)
def test_single_process_refusals(
    refusals: dict[str, subprocess.CompletedProcess], name: str, key: str, hints: tuple[str, ...]
) -> None:
    """One paragraph naming the key and what would work; exit code 2; no traceback."""
    proc = refusals[name]
    assert proc.returncode == EXIT_USER_ERROR, explain(proc)
    assert TRACEBACK not in proc.stderr + proc.stdout, explain(proc)
    err = error_lines(proc)
    assert f"invalid config `{key}`" in err, explain(proc)
    for hint in hints:
        assert hint in err, explain(proc)
    assert not (Path(proc.args[-1].split("=", 1)[1]) / "checkpoints").exists()


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("name", "key", "hint"),
    [
        ("noise_scale", "callbacks.noise_scale", "micro-batch"),
        ("no_stages", "dist.pp", "pipeline_stage"),
        ("sam", "step", "accumulate"),
    ],
)
def test_torchrun_refusals(
    refusals: dict[str, subprocess.CompletedProcess], name: str, key: str, hint: str
) -> None:
    """Under torchrun the workers refuse at startup with the one-paragraph error (rank 0
    prints it), exit with the user-error code, and the launcher exits non-zero."""
    proc = refusals[name]
    assert proc.returncode != 0, explain(proc)
    err = error_lines(proc)
    assert f"invalid config `{key}`" in err, explain(proc)
    assert hint in err, explain(proc)
    # The worker exited by itself with the user-error code (the traceback torchrun prints is
    # the launcher's own ChildFailedError); rank 0 alone printed the paragraph.
    assert f"(exitcode: {EXIT_USER_ERROR})" in proc.stderr, explain(proc)
    assert err.count("invalid config") == 1, explain(proc)


@pytest.mark.multiproc
def test_interleaved_accum_not_multiple_of_pp_is_a_config_error(
    refusals: dict[str, subprocess.CompletedProcess],
) -> None:
    """dist.pp_virtual needs train.grad_accum_steps to be a multiple of dist.pp: that is a
    config error naming the key, not a crash in the schedule."""
    proc = refusals["accum_not_multiple"]
    assert proc.returncode != 0, explain(proc)
    assert "ValueError" not in proc.stderr, explain(proc)
    err = error_lines(proc)
    assert re.search(r"invalid config `(train\.grad_accum_steps|dist\.pp\w*)`", err), explain(proc)


# =========================================================================== 6. transformers

# Tiny transformers models on padded variable-length documents, a checkpoint at the last step:
# (extra args, steps, validation steps).
HF_CASES = {
    # Split by the config's `base_model_pp_plan` (embedding, layers, norm): the stage runs
    # transformers' own base forward on its layers.
    "hf_llama": (
        [
            "model=hf_llama",
            "model.config.num_hidden_layers=4",
            "model.config.max_position_embeddings=64",
            "checkpoint.every_steps=6",
        ],
        STEPS,
        [3, 6],
    ),
    # GPT-2's own stage (trainer/models/hf.py `GPT2Stage`): wte + wpe on the first stage, the
    # output layer tied to wte on the last, blocks only in the middle. The one-process run's
    # text sample stops at n_positions (200 tokens would overrun the position table).
    "hf_gpt2": (
        [
            "model=hf_gpt2",
            "model.config.n_layer=4",
            "train.max_steps=4",
            "eval.every_steps=2",
            "checkpoint.every_steps=4",
        ],
        [1, 2, 3, 4],
        [2, 4],
    ),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("model", sorted(HF_CASES))
def test_hf_stages_train_like_one_process(tmp_path: Path, model: str) -> None:
    """A transformers model on 4 interleaved stages over 2 ranks (first, two middle, last)
    with padded variable-length documents, against the same model on one process: loss and
    gradient norm every step, validation loss, within 1e-5; the last step's checkpoint holds
    the whole model under transformers' parameter names, the one-process run's weights."""
    pytest.importorskip("transformers")
    extra, steps, val_steps = HF_CASES[model]
    args = [*(a for a in ACCUM8 if not a.startswith("model")), *UNPACKED, *extra]
    procs = launch_all(
        {
            "one": python([*args, f"hydra.run.dir={tmp_path / 'one'}"]),
            "pp": torchrun(2, [*args, *INTERLEAVED, f"hydra.run.dir={tmp_path / 'pp'}"]),
        },
        TIMEOUT,
        TMPDIR=str(tmp_path),
    )
    for proc in procs.values():
        ok(proc)
    got, want = read_metrics(tmp_path / "pp"), read_metrics(tmp_path / "one")
    assert_close(train_records(got), train_records(want), TRAIN_KEYS, steps)
    assert_close(val_records(got), val_records(want), ("val/loss",), val_steps)
    assert "pipeline 2 stages" in procs["pp"].stdout, explain(procs["pp"])
    saved = [
        torch.load(checkpoint(tmp_path / n, steps[-1]) / "state.pt", weights_only=False)
        for n in ("pp", "one")
    ]
    mp, mo = (state["model"] for state in saved)
    assert sorted(mp) == sorted(mo), sorted(set(mp) ^ set(mo))
    worst = max((mp[k].float() - mo[k].float()).abs().max().item() for k in mo)
    assert worst <= ATOL, worst


def tiny_gpt2(attn_implementation: str) -> torch.nn.Module:
    from trainer.models.hf import causal_lm

    torch.manual_seed(0)
    config = {"vocab_size": 64, "n_positions": 32, "n_embd": 32, "n_layer": 4, "n_head": 2}
    config |= {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False}
    config |= {"bos_token_id": None, "eos_token_id": None}
    return causal_lm("gpt2", {**config, "attn_implementation": attn_implementation})


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_gpt2_stages_chained_are_the_model(attn_implementation: str) -> None:
    """Three GPT-2 stages (blocks [0], [1, 2], [3]) called one after the other, as the
    pipeline does, on a dict batch with an `attention_mask` (a right- and a left-padded row)
    and `token_type_ids`, give the whole model's logits and gradients exactly: position ids,
    the causal mask with padding and the embeddings are the base model's."""
    pytest.importorskip("transformers")
    model = tiny_gpt2(attn_implementation)
    ids = torch.randint(0, 64, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.int64)
    mask[1, 6:], mask[2, :3] = 0, 0
    batch = {"attention_mask": mask, "token_type_ids": torch.randint(0, 64, (3, 10))}
    grad_out = torch.randn(3, 10, 64)

    model(input_ids=ids, **batch).logits.backward(grad_out)
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    splits = [[0], [1, 2], [3]]
    stages = [model.pipeline_stage(b, i == 0, i == 2) for i, b in enumerate(splits)]
    assert type(stages[0]).__name__ == "GPT2Stage"
    params = {id(p) for p in model.parameters()}
    assert all(id(p) in params for st in stages for p in st.parameters())  # shared, not copied
    wpe, wte = model.transformer.wpe.weight, model.transformer.wte.weight
    assert [any(p is wpe for p in st.parameters()) for st in stages] == [True, False, False]
    assert [any(p is wte for p in st.parameters()) for st in stages] == [True, False, True]
    hidden = ids
    for st in stages:
        hidden = st(hidden, **batch)
    assert torch.equal(hidden, model(input_ids=ids, **batch).logits)
    hidden.backward(grad_out)
    got = {n: p.grad for n, p in model.named_parameters()}
    assert sorted(got) == sorted(want)
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst == 0.0, worst
