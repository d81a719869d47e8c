"""Evaluation: exact global validation loss, no effect on training, the `trainer.evaluate` CLI.

References are computed here with plain torch (one forward per unpadded sample, float64 sums),
never with the trainer's own evaluation code. Runs that several tests read are made once per
module; every subprocess has a deadline after which it and its children are killed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from engine.distributed import DistInfo
from engine.evaluate import evaluate
from engine.numerics.precision import Precision
from tests.conftest import (
    CONFIG_DIR,
    TINY,
    one_thread,
    read_metrics,
    train_in_process,
    train_records,
)
from tests.ranks import explain, launch_all, torchrun_cmd
from trainer.data.text import TextCfg, load_splits
from trainer.models.gpt import GPT, GPTConfig

STEPS = 6
EVAL_EVERY = 3
# 3 batches of 5: 15 validation samples, odd, so two ranks hold 8 and 7.
EVAL_BATCHES, EVAL_BATCH_SIZE = 3, 5
EVAL_ARGS = [
    "data.packed=false",
    f"train.max_steps={STEPS}",
    f"eval.every_steps={EVAL_EVERY}",
    f"eval.max_batches={EVAL_BATCHES}",
    f"eval.batch_size={EVAL_BATCH_SIZE}",
    "eval.sample_tokens=0",
]
CLI_TIMEOUT = 90.0
TORCHRUN_TIMEOUT = 120.0


# --------------------------------------------------------------------------- helpers


def evaluate_cmd(args: list[str], nproc: int = 0) -> list[str]:
    """`python -m trainer.evaluate args`, or under `torchrun --nproc_per_node=nproc`."""
    if nproc:
        return [*torchrun_cmd(nproc), "-m", "trainer.evaluate", *args]
    return [sys.executable, "-m", "trainer.evaluate", *args]


def last_json(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    assert proc.returncode == 0, explain(proc)
    lines = proc.stdout.strip().splitlines()
    assert lines, explain(proc)
    return json.loads(lines[-1])


def eval_records(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in records if "val/loss" in r}


def train_curve(records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    keys = ("step", "train/loss", "train/grad_norm", "train/lr")
    return [tuple(r[k] for k in keys) for r in train_records(records)]


def tiny_model_cfg() -> GPTConfig:
    """gpt_tiny as its YAML file states it, read without the trainer's config machinery."""
    spec = yaml.safe_load((CONFIG_DIR / "model" / "gpt_tiny.yaml").read_text())
    return GPTConfig(**{k: v for k, v in spec.items() if k in GPTConfig.__dataclass_fields__})


def val_samples(n: int) -> list[torch.Tensor]:
    """The first `n` validation samples (unpacked, gpt_tiny's block size)."""
    splits = load_splits(TextCfg(packed=False, block_size=tiny_model_cfg().block_size))
    assert len(splits.val) >= n
    return [splits.val[i] for i in range(n)]


def reference_loss(checkpoint: Path, samples: list[torch.Tensor]) -> tuple[float, int]:
    """Sum of per-token cross-entropy over `samples` / number of target tokens.

    One forward per sample (no padding, no batching), in eval mode, sums in float64.
    """
    model = GPT.from_config(tiny_model_cfg())
    model.load_state_dict(torch.load(checkpoint / "state.pt", weights_only=True)["model"])
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), one_thread():
        for s in samples:
            inputs, targets = s[:-1].unsqueeze(0), s[1:]
            logits = model(inputs)[0].double()  # (T, V)
            total += F.cross_entropy(logits, targets, reduction="sum").item()
            count += targets.numel()
    return total / count, count


# --------------------------------------------------------------------------- shared runs


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The same dropout run without evaluation, with it, and with EMA's extra evaluation."""
    root = tmp_path_factory.mktemp("trajectories")
    base = [*TINY, "model.dropout=0.1", "data.packed=false", "eval.max_batches=4"]
    variants = {
        "no_eval": ["eval.every_steps=0"],
        # Default eval.sample_tokens: the text sample must not disturb training either.
        "eval": ["eval.every_steps=3"],
        "eval_ema": ["eval.every_steps=3", "callbacks=ema", "eval.sample_tokens=0"],
    }
    with one_thread():
        return {
            name: train_in_process([*base, *extra], root / name) for name, extra in variants.items()
        }


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, micro 8 x accum 2, evaluations and checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("eval_run")
    with one_thread():
        train_in_process([*TINY, *EVAL_ARGS, f"checkpoint.every_steps={EVAL_EVERY}"], run_dir)
    return run_dir


@pytest.fixture(scope="module")
def cli(eval_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every single-process `trainer.evaluate` command of this module, launched together."""
    ckpt = checkpoint_of(eval_run, 3)
    missing = tmp_path_factory.mktemp("missing") / "does_not_exist"
    cmds = {
        "step3": evaluate_cmd([f"checkpoint={ckpt}"]),
        "fewer": evaluate_cmd([f"checkpoint={ckpt}", "eval.max_batches=2"]),
        "no_checkpoint": evaluate_cmd(["eval.max_batches=2"]),
        "nonexistent": evaluate_cmd([f"checkpoint={missing}"]),
        "bogus_key": evaluate_cmd([f"checkpoint={ckpt}", "eval.bogus=1"]),
        # Group selections, as training takes them: the same model and data, chosen again.
        "groups": evaluate_cmd(
            [
                f"checkpoint={ckpt}",
                "model=gpt_tiny",
                "logger=none",
                "data=stdlib",
                "data.packed=false",
            ]
        ),
        "unknown_group": evaluate_cmd([f"checkpoint={ckpt}", "data=nope"]),
    }
    return launch_all(cmds, CLI_TIMEOUT)


@pytest.fixture(scope="module")
def multi(eval_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 2-rank commands: training as `eval_run` with micro 4, and evaluating its step 6."""
    run_dir = tmp_path_factory.mktemp("ddp")
    args = [*TINY, *EVAL_ARGS, "train.micro_batch_size=4", f"hydra.run.dir={run_dir}"]
    cmds = {
        "train": [*torchrun_cmd(2), "-m", "trainer.train", *args],
        "evaluate": evaluate_cmd([f"checkpoint={checkpoint_of(eval_run, 6)}"], nproc=2),
    }
    return {**launch_all(cmds, TORCHRUN_TIMEOUT), "run_dir": run_dir}


def checkpoint_of(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    assert (path / "state.pt").is_file(), sorted((run_dir / "checkpoints").iterdir())
    return path


# --------------------------------------------------------------------------- tests


def test_evaluation_does_not_change_training(
    trajectories: dict[str, list[dict[str, Any]]],
) -> None:
    """Evaluating (eval mode, own sampling generator) must consume no training randomness."""
    reference = train_curve(trajectories["no_eval"])
    assert len(reference) == 10
    assert not eval_records(trajectories["no_eval"])
    for name in ("eval", "eval_ema"):
        assert sorted(eval_records(trajectories[name])) == [3, 6, 9, 10], name
        assert train_curve(trajectories[name]) == reference, name


def test_ema_evaluates_its_own_weights_and_restores_the_model(
    trajectories: dict[str, list[dict[str, Any]]],
) -> None:
    """`val/loss_ema` is reported, and evaluation puts the live weights back afterwards."""
    plain, ema = eval_records(trajectories["eval"]), eval_records(trajectories["eval_ema"])
    for step, record in ema.items():
        assert math.isfinite(record["val/loss_ema"]), record
        # Same trajectory and validation set: the live weights' loss is unchanged by EMA...
        assert record["val/loss"] == plain[step]["val/loss"], step
        # ...and the EMA weights really were swapped in (they differ from the live ones).
        assert record["val/loss_ema"] != record["val/loss"], step


def test_val_loss_is_the_exact_global_token_mean(eval_run: Path) -> None:
    """Padded, batched evaluation equals per-sample CE summed over all valid tokens / count."""
    samples = val_samples(EVAL_BATCHES * EVAL_BATCH_SIZE)
    assert len(samples) % 2 == 1
    assert len({len(s) for s in samples}) > 1, "samples should have different lengths"
    records = eval_records(read_metrics(eval_run))
    assert sorted(records) == [3, 6]
    for step, record in records.items():
        want, count = reference_loss(checkpoint_of(eval_run, step), samples)
        assert record["val/items"] == count
        assert math.isclose(record["val/loss"], want, rel_tol=0, abs_tol=1e-6), (step, record, want)
        assert math.isclose(record["val/ppl"], math.exp(want), rel_tol=1e-5)


@pytest.mark.multiproc
def test_two_ranks_give_the_same_val_loss(eval_run: Path, multi: dict[str, Any]) -> None:
    """15 validation samples over 2 ranks (8 + 7): none dropped or counted twice."""
    assert multi["train"].returncode == 0, explain(multi["train"])
    single = eval_records(read_metrics(eval_run))
    ddp = eval_records(read_metrics(multi["run_dir"]))
    assert sorted(ddp) == sorted(single) == [3, 6]
    for step in single:
        assert ddp[step]["val/items"] == single[step]["val/items"], step
        assert math.isclose(
            ddp[step]["val/loss"], single[step]["val/loss"], rel_tol=0, abs_tol=1e-6
        ), (step, ddp[step], single[step])


@pytest.mark.launches
def test_evaluate_cli_matches_training(eval_run: Path, cli: dict[str, Any]) -> None:
    """The CLI rebuilds model and data from the checkpoint and gets the run's val/loss."""
    trained = eval_records(read_metrics(eval_run))
    ckpt = checkpoint_of(eval_run, 3)
    got = last_json(cli["step3"])
    assert got["step"] == 3
    assert got["val/items"] == trained[3]["val/items"]
    assert math.isclose(got["val/loss"], trained[3]["val/loss"], rel_tol=0, abs_tol=1e-9)

    # Fewer batches: the first 2 * 5 samples, checked against the independent reference.
    fewer = last_json(cli["fewer"])
    want, count = reference_loss(ckpt, val_samples(2 * EVAL_BATCH_SIZE))
    assert fewer["val/items"] == count < got["val/items"]
    assert math.isclose(fewer["val/loss"], want, rel_tol=0, abs_tol=1e-6), (fewer, want)


@pytest.mark.launches
def test_evaluate_cli_takes_group_selections(eval_run: Path, cli: dict[str, Any]) -> None:
    """`model=...`, `data=...`, `logger=...` select groups as in training (they used to fail
    with Hydra's raw merge error); re-selecting the run's own choices changes nothing."""
    trained = eval_records(read_metrics(eval_run))
    got = last_json(cli["groups"])
    assert got["val/items"] == trained[3]["val/items"]
    assert math.isclose(got["val/loss"], trained[3]["val/loss"], rel_tol=0, abs_tol=1e-9)
    proc = cli["unknown_group"]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, explain(proc)
    assert "nope" in proc.stderr and "stdlib" in proc.stderr, explain(proc)


@pytest.mark.multiproc
def test_evaluate_cli_under_torchrun(eval_run: Path, multi: dict[str, Any]) -> None:
    """Two ranks split the 15 samples; only rank 0 prints, and the loss is the same."""
    trained = eval_records(read_metrics(eval_run))
    proc = multi["evaluate"]
    got = last_json(proc)
    assert sum(line.startswith("{") for line in proc.stdout.splitlines()) == 1, explain(proc)
    assert got["step"] == 6
    assert got["val/items"] == trained[6]["val/items"]
    assert math.isclose(got["val/loss"], trained[6]["val/loss"], rel_tol=0, abs_tol=1e-6)


@pytest.mark.launches
@pytest.mark.parametrize(
    ("case", "expect"),
    [("no_checkpoint", "usage"), ("nonexistent", "does_not_exist"), ("bogus_key", "bogus")],
)
def test_evaluate_cli_bad_input(case: str, expect: str, cli: dict[str, Any]) -> None:
    """Bad input is one clear error naming the problem, a non-zero exit and no traceback."""
    proc = cli[case]
    assert proc.returncode != 0, explain(proc)
    assert "Traceback" not in proc.stderr + proc.stdout, explain(proc)
    assert expect in proc.stderr, explain(proc)
    assert not proc.stdout.strip().startswith("{"), explain(proc)


class _Probe:
    """A task that records, per batch, whether inference mode was on and the model's mode."""

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[tuple[bool, bool]] = []
        self.fail = fail

    def count_items(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.tensor(batch.shape[0])

    def loss_sum(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.is_inference_mode_enabled(), model.training))
        if self.fail:
            raise RuntimeError("probe failure")
        return model(batch).sum()


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_loss_modes(training: bool) -> None:
    """Inside: inference mode and eval mode. After: the caller's mode, also after an error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    model.train(training)
    batches = [torch.randn(2, 3), torch.randn(3, 3)]
    task = _Probe()
    with torch.enable_grad():  # evaluation must not rely on the caller disabling autograd
        means, count = evaluate(model, task, batches, Precision("fp32", "cpu"), DistInfo())
    loss = means["loss"]
    assert task.seen == [(True, False), (True, False)]
    assert model.training is training
    assert all(m.training is training for m in model.modules())
    assert count == 5
    with torch.no_grad():
        model.eval()
        want = sum(model(b).sum().double().item() for b in batches) / 5
    assert math.isclose(loss, want, rel_tol=1e-12)

    model.train(training)
    failing = _Probe(fail=True)
    with pytest.raises(RuntimeError, match="probe failure"):
        evaluate(model, failing, batches, Precision("fp32", "cpu"), DistInfo())
    assert failing.seen == [(True, False)]
    assert model.training is training


def test_text_sample_in_eval_records(trajectories: dict[str, list[dict[str, Any]]]) -> None:
    """Default settings write a text sample with each evaluation; sample_tokens=0 removes it."""
    default = eval_records(trajectories["eval"])
    assert default
    for record in default.values():
        assert isinstance(record["val/sample"], str) and record["val/sample"].strip(), record
    for record in eval_records(trajectories["eval_ema"]).values():
        assert "val/sample" not in record


def test_only_a_model_split_over_ranks_makes_every_rank_generate() -> None:
    """The text sample: where each rank holds the whole model (one process, DDP), rank 0
    generates alone; FSDP2's shards (DTensor parameters, as a tensor-parallel split's) make
    every rank's forward part of rank 0's, so every rank generates with it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.planning.simulate import fake_world
    from trainer.run.fit import forward_is_collective

    model = GPT(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
    assert not forward_is_collective(model)
    with fake_world(0, 2):
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        assert forward_is_collective(model)
