"""`train.micro_batch_size=auto` through the real trainer, with a model that runs out of memory
(a real `torch.OutOfMemoryError`) above a micro-batch size it is given
(`tests/auto_batch_support.py`).

Every auto run is compared with an independent reference: the same config with the chosen
micro-batch size set by hand, run from the start. Losses, and parameters, optimizer state,
GradScaler state and module buffers of the final checkpoint must agree (float64: 1e-12;
fp16 autocast on fp32 parameters: 1e-6).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY, read_metrics, train_in_process, train_records
from tests.ranks import explain, launch_all, run_cli, torchrun_cmd
from trainer.config.errors import UserError
from trainer.tracking import records  # noqa: F401  (imported before capsys: Progress binds sys.stdout)

MODEL = "model._target_=tests.auto_batch_support.LimitedGPT"
OOM_STEP = "+callbacks.oom={_target_:tests.auto_batch_support.OomInStep,"
LOWER = "+callbacks.lower={_target_:tests.auto_batch_support.LowerLimit,"


def overrides(steps: int, global_batch: int, micro: int | str, *extra: str) -> list[str]:
    return [
        *TINY,
        MODEL,
        f"train.max_steps={steps}",
        f"train.global_batch_size={global_batch}",
        f"train.micro_batch_size={micro}",
        f"checkpoint.every_steps={steps}",
        *extra,
    ]


def final_state(run_dir: Path) -> dict[str, Any]:
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return torch.load(newest / "state.pt", weights_only=True)


def max_diff(a: Any, b: Any, path: str = "") -> float:
    """Largest absolute difference between two nested states (structure must match)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, path
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, set(a) ^ set(b))
        return max((max_diff(a[k], b[k], f"{path}.{k}") for k in a), default=0.0)
    if isinstance(a, list | tuple):
        assert len(a) == len(b), path
        return max(
            (max_diff(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b))), default=0
        )
    if isinstance(a, float):
        return abs(a - b)
    assert a == b, (path, a, b)
    return 0.0


def assert_same_run(auto_dir: Path, hand_dir: Path, tol: float) -> None:
    """Losses of every step, and the final model (buffers included), optimizer, scheduler and
    GradScaler state."""
    auto, hand = train_records(read_metrics(auto_dir)), train_records(read_metrics(hand_dir))
    assert [r["step"] for r in auto] == [r["step"] for r in hand]
    for a, h in zip(auto, hand, strict=True):
        assert abs(a["train/loss"] - h["train/loss"]) <= tol, (a, h)
    a, h = final_state(auto_dir), final_state(hand_dir)
    for key in ("model", "optimizer", "scheduler", "precision"):
        assert max_diff(a[key], h[key], key) <= tol, key


def sizes(run_dir: Path) -> list[int]:
    return [r["train/micro_batch_size"] for r in train_records(read_metrics(run_dir))]


def test_probe_picks_largest_fitting_divisor_and_undoes_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Divisors of 12 with at most 5 fitting: 4. The probe's tries (forward, backward and an
    optimizer step each) leave no trace: BatchNorm statistics, parameters, optimizer state and
    RNG equal a run with micro-batch 4 set by hand."""
    common = ("+model.batchnorm=true", "+model.float64=true", "model.dropout=0.1")
    train_in_process(overrides(3, 12, "auto", "+model.fit=5", *common), tmp_path / "auto")
    out = capsys.readouterr().out
    assert "chose 4 of the divisors of the per-rank batch 12" in out, out
    assert "12 out of memory" in out and "6 out of memory" in out and "4 fits" in out, out
    train_in_process(overrides(3, 12, 4, *common), tmp_path / "hand")
    assert sizes(tmp_path / "auto") == [4, 4, 4]
    assert "train/micro_batch_size" not in train_records(read_metrics(tmp_path / "hand"))[0]
    assert final_state(tmp_path / "auto")["callbacks"]["auto_micro_batch"] == {
        "micro_batch_size": 4
    }
    assert_same_run(tmp_path / "auto", tmp_path / "hand", 1e-12)


def test_probe_uses_the_longest_samples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Padded variable-length samples, memory for 5 x 64 tokens: the probe measures the longest
    sample (64 tokens; the first one has 19), so it chooses 4, and no later micro-batch runs
    out of memory."""
    args = overrides(3, 16, "auto", "data.packed=false", "+model.fit_tokens=320")
    train_in_process(args, tmp_path)
    captured = capsys.readouterr()
    assert "chose 4 of the divisors" in captured.out, captured.out
    assert "shrinking" not in captured.err, captured.err
    assert sizes(tmp_path) == [4, 4, 4]


def test_oom_in_the_middle_of_a_window_redoes_it_smaller(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Micro-batch 8 fits until step 2; at step 3 the second micro-batch's forward runs out of
    memory: the window is redone at 4 and the run goes on like one started at 4 (float64)."""
    lower = LOWER + "at_step:2,fit:4,skip:1}"
    train_in_process(
        overrides(4, 16, "auto", "+model.fit=8", "+model.float64=true", lower), tmp_path / "auto"
    )
    err = capsys.readouterr().err
    assert "micro-batch 2/2 at step 3; shrinking the micro-batch to 4" in err, err
    assert sizes(tmp_path / "auto") == [8, 8, 4, 4]
    train_in_process(overrides(4, 16, 4, "+model.float64=true"), tmp_path / "hand")
    assert_same_run(tmp_path / "auto", tmp_path / "hand", 1e-12)


def test_mixture_of_experts_window_is_redone_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mixture of experts balanced over the whole step (moe.balance=global): the probe, and
    the window redone at 4 after an out-of-memory error in its second micro-batch, run the
    routing pass again for the new micro-batches, and the run equals one started at 4
    (float64), its balancing records too."""
    moe = ("+model.moe.experts=4", "+model.moe.top_k=2", "moe=global", "moe.aux_coef=1.0")
    common = (*moe, "+model.float64=true")
    lower = LOWER + "at_step:2,fit:4,skip:1}"
    train_in_process(overrides(4, 16, "auto", "+model.fit=8", lower, *common), tmp_path / "auto")
    err = capsys.readouterr().err
    assert "micro-batch 2/2 at step 3; shrinking the micro-batch to 4" in err, err
    assert sizes(tmp_path / "auto") == [8, 8, 4, 4]
    train_in_process(overrides(4, 16, 4, *common), tmp_path / "hand")
    assert_same_run(tmp_path / "auto", tmp_path / "hand", 1e-12)
    auto, hand = (
        train_records(read_metrics(tmp_path / "auto")),
        train_records(read_metrics(tmp_path / "hand")),
    )
    for a, h in zip(auto, hand, strict=True):
        assert abs(a["train/moe_aux_loss"] - h["train/moe_aux_loss"]) <= 1e-12, (a, h)


def test_fp16_batchnorm_window_rolled_back(tmp_path: Path) -> None:
    """fp16 with a GradScaler and BatchNorm: an OOM in the first window's second micro-batch,
    after the first one updated the running statistics. Buffers and scaler roll back."""
    common = ("train.precision=fp16", "+model.batchnorm=true")
    lower = LOWER + "at_step:0,fit:4,skip:1}"
    train_in_process(overrides(2, 16, "auto", "+model.fit=8", lower, *common), tmp_path / "auto")
    assert sizes(tmp_path / "auto") == [4, 4]
    train_in_process(overrides(2, 16, 4, *common), tmp_path / "hand")
    assert_same_run(tmp_path / "auto", tmp_path / "hand", 1e-6)


def test_oom_in_the_optimizer_step_undoes_the_update(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp16 with a GradScaler: the first optimizer step runs out of memory after its update
    (parameters changed, Adam's moments created, the scaler's scale initialised and updated).
    The update is undone and the window redone at 4: the run equals one started at 4."""
    common = ("train.precision=fp16", "+model.batchnorm=true")
    oom = OOM_STEP + "at_step:1,fit:4}"
    train_in_process(overrides(2, 16, "auto", "+model.fit=8", oom, *common), tmp_path / "auto")
    err = capsys.readouterr().err
    assert "optimizer step at step 1; shrinking the micro-batch to 4" in err, err
    assert sizes(tmp_path / "auto") == [4, 4]
    train_in_process(overrides(2, 16, 4, *common), tmp_path / "hand")
    assert_same_run(tmp_path / "auto", tmp_path / "hand", 1e-6)


def test_resume_probes_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The size is saved in checkpoints and probed again on resume (another machine); a run
    started with a number may go on with auto. With activation checkpointing and bf16."""
    run_dir = tmp_path / "run"
    extra = ("model.activation_checkpointing=true", "train.precision=bf16")
    train_in_process(overrides(1, 16, 8, "checkpoint.every_steps=1", *extra), run_dir)
    args = overrides(2, 16, "auto", "checkpoint.every_steps=1", *extra)
    train_in_process([*args, "+model.fit=8"], run_dir)
    assert final_state(run_dir)["callbacks"]["auto_micro_batch"] == {"micro_batch_size": 8}
    capsys.readouterr()
    train_in_process([*args, "train.max_steps=3", "+model.fit=2"], run_dir)
    out = capsys.readouterr().out
    assert "trained with micro-batch 8, the probe on this machine chose 2" in out, out
    assert [r.get("train/micro_batch_size") for r in train_records(read_metrics(run_dir))] == [
        None,
        8,
        2,
    ]


def test_wandb_config_records_the_choice(tmp_path: Path) -> None:
    from tests.wandb_reader import read_records

    args = [a for a in overrides(1, 16, "auto", "+model.fit=8") if not a.startswith("logger=")]
    train_in_process(args, tmp_path)
    config = {}
    for record in read_records(next(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            items = record.run.config.update if kind == "run" else record.config.update
            config.update({i.key: json.loads(i.value_json) for i in items})
    assert config["micro_batch_size_auto"] == 8, config
    assert config["train"]["micro_batch_size"] == "auto"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["train.global_batch_size=null"], "set train.global_batch_size"),
        (["step=sam"], "SAMStep is not supported"),
        (["callbacks=noise_scale"], "observe every micro-batch"),
        (["+model.fit=0"], "not even a micro-batch of 1 sample fits"),
    ],
)
def test_refused_with_one_paragraph(tmp_path: Path, extra: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message) as info:
        train_in_process(overrides(1, 8, "auto", *extra), tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.launches
def test_cli_exit_2_on_bad_value(tmp_path: Path) -> None:
    proc = run_cli([*TINY, "train.micro_batch_size=big", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 2, explain(proc)
    assert "train.micro_batch_size" in proc.stderr and "auto" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr


@pytest.mark.multiproc
def test_two_ranks_agree(tmp_path: Path) -> None:
    """DDP on 2 ranks, float64. The probe: forward OOM on rank 0 only above 5 of the per-rank
    12: both ranks choose 4. Step 2: OOM in the *last* micro-batch's backward on rank 1 only
    (DDP's bucketed all-reduce would hang here): both ranks redo the window at 2. The run
    equals a 2-rank run at micro-batch 2 set by hand. An OOM at the end of step 2's optimizer
    step on rank 0 only (its update applied, rank 1's too): both ranks undo the update and
    redo the window at 2, again equal to the hand run.

    FSDP2 on 2 ranks, float64, each OOM on one rank while the other goes on to communicate:
    the probe runs out of memory on rank 0 inside the first block's unit (rank 1 goes on to
    the next unit's all-gather): 4. Step 2: the last micro-batch's backward on rank 1 (rank 0
    is entering a reduce-scatter; the window's earlier micro-batches left unreduced gradients
    in FSDP2): redone at 2. Step 3: rank 0's optimizer step, after its update: undone, redone
    at 1. Equal to the DDP hand run at 2.
    FSDP2 with fp16 (GradScaler) and BatchNorm: the first window's second micro-batch runs out
    of memory on rank 1 after the first updated the running statistics and left unreduced
    gradients; redone at 4, equal to an FSDP2 fp16 run at 4 (1e-6)."""
    lower = LOWER + "at_step:1,fit:2,skip:2,where:backward,ranks:[1]}"
    common = ("+model.float64=true", "train.log_every=1", "checkpoint.format=full")
    fp16 = ("dist.strategy=fsdp", "train.precision=fp16", "+model.batchnorm=true", *common[1:])
    runs = {
        "auto": overrides(3, 24, "auto", "+model.fit=5", "+model.ranks=[0]", lower, *common),
        "hand": overrides(3, 24, 2, *common),
        "fsdp": overrides(
            3,
            24,
            "auto",
            "dist.strategy=fsdp",
            "+model.fit=5",
            "+model.where=block",
            "+model.ranks=[0]",
            lower,
            OOM_STEP + "at_step:3,fit:1,ranks:[0]}",
            *common,
        ),
        "optim": overrides(
            3, 24, "auto", "+model.fit=5", OOM_STEP + "at_step:2,fit:2,ranks:[0]}", *common
        ),
        "fsdp16": overrides(
            2, 32, "auto", "+model.fit=8", LOWER + "at_step:0,fit:4,skip:1,ranks:[1]}", *fp16
        ),
        "fsdp16_hand": overrides(2, 32, 4, *fp16),
    }
    cmds = {
        name: [*torchrun_cmd(2), "-m", "trainer.train", *args, f"hydra.run.dir={tmp_path / name}"]
        for name, args in runs.items()
    }
    procs = launch_all(cmds, timeout=240, TMPDIR=str(tmp_path))
    for name in runs:
        assert procs[name].returncode == 0, explain(procs[name])
    out, err = procs["auto"].stdout, procs["auto"].stderr
    assert "chose 4 of the divisors of the per-rank batch 12" in out, explain(procs["auto"])
    assert "micro-batch 3/3 at step 2; shrinking the micro-batch to 2" in err, err
    assert sizes(tmp_path / "auto") == [4, 2, 2]
    assert_same_run(tmp_path / "auto", tmp_path / "hand", 1e-12)
    err = procs["optim"].stderr
    assert "in the gradient clipping or optimizer step at step 2; shrinking the micro" in err, err
    assert sizes(tmp_path / "optim") == [4, 2, 2]
    assert_same_run(tmp_path / "optim", tmp_path / "hand", 1e-12)
    out, err = procs["fsdp"].stdout, procs["fsdp"].stderr
    assert "chose 4 of the divisors of the per-rank batch 12" in out, explain(procs["fsdp"])
    assert "micro-batch 3/3 at step 2; shrinking the micro-batch to 2" in err, err
    assert "optimizer step at step 3; shrinking the micro-batch to 1" in err, err
    assert sizes(tmp_path / "fsdp") == [4, 2, 1]
    assert_same_run(tmp_path / "fsdp", tmp_path / "hand", 1e-12)
    err = procs["fsdp16"].stderr
    assert "micro-batch 2/2 at step 1; shrinking the micro-batch to 4" in err, err
    assert sizes(tmp_path / "fsdp16") == [4, 4]
    assert_same_run(tmp_path / "fsdp16", tmp_path / "fsdp16_hand", 1e-6)


@pytest.mark.multiproc
def test_two_ranks_agree_on_an_oom_in_the_moe_routing_pass(tmp_path: Path) -> None:
    """moe.balance=global on 2 DDP ranks and on 2 FSDP2 ranks, float64: the routing pass
    (forwards without a graph before any backward) runs out of memory on rank 1 only, above 5
    of the per-rank 12 (the probe's forwards keep graphs: it chooses 12); under FSDP2 rank 0
    goes on to the next unit's all-gather. Both ranks agree, as for an OOM in a backward: the
    window is redone at 6 (out of memory again) and at 3, and the run equals one process
    trained at 3 (records, balancing records, final state). Before, rank 1 raised from the
    routing pass outside the guard while rank 0 waited in the counts' all-reduce."""
    moe = ("+model.moe.experts=4", "+model.moe.top_k=2", "moe=global", "moe.aux_coef=1.0")
    common = (*moe, "+model.float64=true", "checkpoint.format=full")
    limit = ("+model.fit=5", "+model.where=routing", "+model.ranks=[1]", "dist.timeout_s=60")
    cmds = {
        name: [
            *torchrun_cmd(2),
            "-m",
            "trainer.train",
            *overrides(2, 24, "auto", *limit, *common, f"dist.strategy={name}"),
            f"hydra.run.dir={tmp_path / name}",
        ]
        for name in ("ddp", "fsdp")
    }
    procs = launch_all(cmds, timeout=180)
    train_in_process(overrides(2, 24, 3, *common), tmp_path / "hand")
    hand = train_records(read_metrics(tmp_path / "hand"))
    for name, proc in procs.items():
        assert proc.returncode == 0, explain(proc)
        assert "chose 12 of the divisors of the per-rank batch 12" in proc.stdout, explain(proc)
        for micro, then in (("1/1", 6), ("1/2", 3)):
            line = f"in the moe routing pass of the micro-batch {micro} at step 1; shrinking the "
            assert line + f"micro-batch to {then}" in proc.stderr, explain(proc)
        assert sizes(tmp_path / name) == [3, 3]
        assert_same_run(tmp_path / name, tmp_path / "hand", 1e-12)
        auto = train_records(read_metrics(tmp_path / name))
        for a, h in zip(auto, hand, strict=True):
            assert abs(a["train/moe_aux_loss"] - h["train/moe_aux_loss"]) <= 1e-12, (name, a, h)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
