"""Context parallelism (`dist.cp`): each sequence split over ranks, the accounting exact.

Every configuration trains the same global batch as a one-process reference run, launched
together once (`runs`); the tests compare their records: loss, gradient norm and validation
loss within 1e-5 at every step, for packed and padded variable-length samples, with data
parallelism, with tensor parallelism, with a transformers Llama, and for a sequence length
that does not divide by 2 x cp. The torchtitan bug (items counted before the split) is
planted in a mutant run, which must fail the same comparison. Checkpoints move from `cp=2`
to one process, and a kill -9 under `cp` reruns bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import read_metrics
from tests.ranks import explain, launch, launch_all, torchrun_cmd
from tests.test_checkpoint import assert_same, kill_at, killed

TOL = 1e-5
STEPS = 8
HALF = STEPS // 2  # validation and a checkpoint here and at the end
COMMON = [
    "logger=none",
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.micro_batch_size=4",
    "train.global_batch_size=16",
    f"eval.every_steps={HALF}",
    "eval.max_batches=2",
    "eval.sample_tokens=0",
    f"checkpoint.every_steps={HALF}",
    "scheduler.warmup_steps=2",
]
GPT = ["model=gpt_tiny", *COMMON]
PADDED = ["data.packed=false"]
# A transformers Llama on padded documents of at most 30 tokens: 30 does not divide by 4.
LLAMA = ["model=hf_llama", *COMMON, *PADDED, "data.block_size=30"]
CP2 = ["dist.cp=2"]
TIMEOUT = 600.0


def python(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainer.train", *args]


def torchrun(n: int, args: list[str], module: str = "trainer.train") -> list[str]:
    return [*torchrun_cmd(n), "-m", module, *args]


# name: (command, reference name or None)
CASES: dict[str, tuple[list[str], str | None]] = {
    "ref_packed": (python(GPT), None),
    "cp2_packed": (torchrun(2, [*GPT, *CP2]), "ref_packed"),
    "ref_padded": (python([*GPT, *PADDED]), None),
    "cp2_padded": (torchrun(2, [*GPT, *PADDED, *CP2]), "ref_padded"),
    "cp2_dp2": (torchrun(4, [*GPT, *PADDED, *CP2]), "ref_padded"),
    "cp2_tp2": (torchrun(4, [*GPT, *PADDED, *CP2, "dist.tp=2"]), "ref_padded"),
    "ref_llama": (python(LLAMA), None),
    "cp2_llama": (torchrun(2, [*LLAMA, *CP2]), "ref_llama"),
    # The planted bug: must differ from its reference (tests/cp_support.py).
    "mutant": (torchrun(2, [*GPT, *CP2], module="tests.cp_support"), "ref_packed"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case launched once, all at once (their imports overlap on 2 cores)."""
    root = tmp_path_factory.mktemp("cp")
    cmds = {name: [*cmd, f"hydra.run.dir={root / name}"] for name, (cmd, _) in CASES.items()}
    results = launch_all(cmds, TIMEOUT, TMPDIR=str(root))
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
    return {name: root / name for name in CASES}


def worst_differences(got: Path, want: Path) -> dict[str, float]:
    """The largest |difference| of loss, grad norm and val loss over every common step; the
    two runs must hold the same steps."""
    g = {(r["step"], "val" if "val/loss" in r else "train"): r for r in read_metrics(got)}
    w = {(r["step"], "val" if "val/loss" in r else "train"): r for r in read_metrics(want)}
    assert sorted(g) == sorted(w), (sorted(g), sorted(w))
    worst = {"train/loss": 0.0, "train/grad_norm": 0.0, "val/loss": 0.0}
    for key, record in w.items():
        for name in worst:
            if name in record:
                worst[name] = max(worst[name], abs(g[key][name] - record[name]))
    assert {s for s, kind in w if kind == "val"} == {HALF, STEPS}
    return worst


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["cp2_packed", "cp2_padded", "cp2_dp2", "cp2_tp2", "cp2_llama"])
def test_context_parallel_trains_like_one_process(runs: dict[str, Path], name: str) -> None:
    """dist.cp=2 (alone, x 2-way data parallel, x dist.tp=2, and a transformers Llama whose
    sequences of 30 tokens pad to 32 and cut back) gives the one-process run's loss, grad
    norm and validation loss at every step, within 1e-5."""
    worst = worst_differences(runs[name], runs[CASES[name][1]])  # type: ignore[index]
    assert all(v <= TOL for v in worst.values()), worst


@pytest.mark.multiproc
def test_counting_items_before_the_split_is_caught(runs: dict[str, Path]) -> None:
    """The mutant counts loss items on the whole sequences on every cp rank (cp times the
    true count): its losses differ from the one-process run's far beyond the tolerance,
    so the equality above is what catches the torchtitan bug."""
    worst = worst_differences(runs["mutant"], runs["ref_packed"])
    assert worst["train/loss"] > 1.0 and worst["train/grad_norm"] > 0.1, worst


@pytest.mark.multiproc
def test_checkpoint_of_cp2_continues_on_one_process(runs: dict[str, Path], tmp_path: Path) -> None:
    """The mid-run (step-4) checkpoint of the cp=2 run resumed by one process continues the
    one-process trajectory (steps 5..8) within 1e-5: the state holds no trace of the
    split."""
    ckpt = runs["cp2_packed"] / "checkpoints" / f"step_{HALF:08d}"
    run_dir = tmp_path / "resumed"
    proc = launch([*python(GPT), f"checkpoint.resume={ckpt}", f"hydra.run.dir={run_dir}"], TIMEOUT)
    assert proc.returncode == 0, explain(proc)
    got = {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}
    want = {r["step"]: r for r in read_metrics(runs["ref_packed"]) if "train/loss" in r}
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    for step, record in got.items():
        for key in ("train/loss", "train/grad_norm"):
            assert abs(record[key] - want[step][key]) <= TOL, (step, key)


@pytest.mark.multiproc
def test_sigkill_under_cp_reruns_bit_for_bit(tmp_path: Path) -> None:
    """With dropout (each cp rank its own stream), kill -9 of rank 1 after step 7 and the
    same command again: every record equals the uninterrupted cp=2 run's exactly."""
    args = [*GPT, *PADDED, *CP2, "model.dropout=0.1", "train.max_steps=12"]
    args += ["checkpoint.every_steps=5", "eval.every_steps=6"]
    marker = tmp_path / "killed"
    cmds = {
        "uninterrupted": torchrun(2, [*args, f"hydra.run.dir={tmp_path / 'ref'}"]),
        "killed": torchrun(
            2, [*args, *kill_at(7, marker, rank=1), f"hydra.run.dir={tmp_path / 'run'}"]
        ),
    }
    first = launch_all(cmds, TIMEOUT, TMPDIR=str(tmp_path))
    assert first["uninterrupted"].returncode == 0, explain(first["uninterrupted"])
    assert first["killed"].returncode != 0 and marker.exists(), explain(first["killed"])
    rerun = launch_all({"rerun": cmds["killed"]}, TIMEOUT, TMPDIR=str(tmp_path))["rerun"]
    assert rerun.returncode == 0, explain(rerun)
    assert not killed(rerun)
    keys = ("train/loss", "train/grad_norm", "val/loss")
    assert_same(read_metrics(tmp_path / "run"), read_metrics(tmp_path / "ref"), keys)


REFUSE = ["logger=none", "train.max_steps=2", "eval.every_steps=0", "checkpoint.every_steps=0"]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("args", "nproc", "key", "hint"),
    [
        (["model=gpt_tiny", *CP2], 1, "dist.cp", "--nproc_per_node=2"),
        (["model=gpt_tiny", *CP2, "dist.cp_impl=ring"], 2, "dist.cp_impl", "allgather"),
        (["experiment=digits", *CP2], 2, "dist.cp", "context_parallel(shard)"),
        (["model=gpt_tiny", *CP2, "step=sam"], 2, "step", "accumulate"),
        (["model=gpt_tiny", "dist.cp_impl=ringg"], 1, "dist.cp_impl", "allgather, ring"),
        # Met at the first step, not at start-up: still one paragraph, exit 2 (not a traceback).
        (
            ["model=hf_llama", "data._target_=tests.cp_support.labelled_dicts", *CP2],
            2,
            "dist.cp",
            "shift_labels",
        ),
    ],
    ids=["one_process", "ring_on_cpu", "no_hook", "sam", "unknown_impl", "labels_dict"],
)
def test_refusals(args: list[str], nproc: int, key: str, hint: str, tmp_path: Path) -> None:
    """What context parallelism cannot run is one paragraph naming the key, exit 2."""
    cmd = python(args) if nproc == 1 else torchrun(nproc, args)
    proc = launch_all({"run": [*cmd, *REFUSE, f"hydra.run.dir={tmp_path}"]}, 120.0)["run"]
    assert proc.returncode != 0, explain(proc)
    err = "\n".join(ln for ln in proc.stderr.splitlines() if ln.startswith("error"))
    assert f"invalid config `{key}`" in err and hint in err, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
