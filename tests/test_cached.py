"""step=cached with task=contrastive (in-batch negatives over the whole global batch),
model=hf_encoder and data=pairs: the gradient of the whole batch, whatever the split.

The reference is computed here, independently of the step: a float64 copy of the same
initial model (2 layers, width 32, random init from the trainer's seed), the whole training
set (24 pairs) in one batch, the InfoNCE loss over all of it, `torch.autograd.grad`. One SGD
step of the trainer must move every weight by -lr x that gradient, the encoder's and the
learned temperature's, within 1e-5 relative, for micro x accumulation 24x1, 4x6 and 3x8 on
one process and 3x4 (DDP) and 4x3 (FSDP2) on 2 ranks. The loss is symmetric, learns its
temperature, and is computed 5 rows at a time (chunks that do not divide any rank's rows).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.contrastive import ContrastiveTask
from tests.cached_support import TINY_BERT, pairs, tiny_bert, write_pairs, write_tokenizer
from tests.conftest import (
    read_metrics,
    rewrite_state,
    stdlib_text,
    train_in_process,
    train_records,
)
from tests.ranks import explain, launch_all, python_cmd, run_cli, torchrun
from trainer.config.errors import ConfigError, UserError

SEED = 1337  # the trainer's default seed
LR = 0.5
N_TRAIN = 24
TIMEOUT = 180.0
TEMPERATURE = "loss_parameters.log_scale"
N_VAL, EVAL_BATCH = 8, 7


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pairs")
    return {
        "tokenizer": write_tokenizer(root / "tokenizer"),
        "train": write_pairs(root / "train.jsonl", N_TRAIN, seed=0),
        "val": write_pairs(root / "val.jsonl", N_VAL, seed=1),
    }


def contrastive(
    files: dict[str, Path], dropout: float = 0.0, model: list[str] | None = None
) -> list[str]:
    """task=contrastive on the pairs; the model at TINY_BERT's shapes, or `model`."""
    return [
        *(tiny_bert(dropout) if model is None else model),
        "task=contrastive",
        "task.learn_temperature=true",
        "task.symmetric=true",
        "data=pairs",
        f"data.path={files['train']}",
        f"data.val_path={files['val']}",
        f"data.tokenizer={files['tokenizer']}",
        "logger=none",
    ]


def one_sgd_step(
    files: dict[str, Path],
    run_dir: Path,
    micro: int,
    accum: int,
    cached: bool = True,
    model: list[str] | None = None,
) -> list[str]:
    """One plain SGD step over the whole training set, saved whole at step 1."""
    return [
        *contrastive(files, model=model),
        *(["step=cached", "step.chunk_size=5"] if cached else []),
        "optim=sgd",
        "optim.momentum=0.0",
        "optim.weight_decay=0.0",
        f"optim.lr={LR}",
        "scheduler=constant",
        "train.clip_grad_norm=null",
        "train.max_steps=1",
        "train.log_every=1",
        f"train.micro_batch_size={micro}",
        f"train.grad_accum_steps={accum}",
        # The 8 validation pairs in evaluation batches of 7 and 1: on 2 ranks the second
        # batch's share of rank 1 is empty.
        "eval.every_steps=1",
        f"eval.batch_size={EVAL_BATCH}",
        "eval.max_batches=null",
        "checkpoint.every_steps=1",
        "checkpoint.format=full",
        f"hydra.run.dir={run_dir}",
    ]


NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_pretrained BERT at TINY_BERT's shapes whose config.json says dropout 0.0 (the
    in-tree model=hf_encoder's random init has 0.1)."""
    from trainer.models.encoder import encoder

    folder = tmp_path_factory.mktemp("pretrained") / "bert"
    torch.manual_seed(7)
    encoder(config={**TINY_BERT, **NO_DROPOUT}).save_pretrained(folder)
    return folder


def from_directory(folder: Path) -> list[str]:
    """model=hf_encoder loading `folder`, naming no model.config field."""
    return ["model=hf_encoder", f"model.pretrained={folder}"]


def whole_batch(model: torch.nn.Module, files: dict[str, Path]) -> dict[str, Any]:
    """`model`'s weights (float32) and the whole batch's loss and its gradient in float64,
    without dropout (eval mode)."""
    from trainer.data.pairs import pairs_data

    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = model.double().eval()
    task = ContrastiveTask(temperature=0.05, learn_temperature=True, symmetric=True)
    assert task.scale is not None
    task.scale.double()
    initial[TEMPERATURE] = task.scale.log_scale.detach().float().clone()
    data = pairs_data(str(files["train"]), str(files["val"]), tokenizer=str(files["tokenizer"]))
    assert len(data.train) == N_TRAIN
    assert data.collate_fn is not None
    batch = data.collate_fn([data.train[i] for i in range(N_TRAIN)])
    reps = task.represent(model, batch)  # (24, 2, 32): no micro-batches, no chunks
    loss = task.window_loss(reps, slice(0, N_TRAIN)) / N_TRAIN
    params = {**dict(model.named_parameters()), TEMPERATURE: task.scale.log_scale}
    grads = torch.autograd.grad(loss, list(params.values()))
    return {"loss": loss.item(), "initial": initial, "grad": dict(zip(params, grads))}


@pytest.fixture(scope="module")
def reference(files: dict[str, Path]) -> dict[str, Any]:
    """The initial weights as the trainer builds them at random init, and the whole batch's
    loss and gradient in float64."""
    from trainer.models.encoder import encoder

    torch.manual_seed(SEED)  # what the trainer seeds before it builds the model
    return whole_batch(encoder(config={**TINY_BERT, **NO_DROPOUT}), files)


@pytest.fixture(scope="module")
def pretrained_reference(files: dict[str, Path], pretrained: Path) -> dict[str, Any]:
    """The same of the pretrained directory's weights, read by transformers itself."""
    from transformers import BertModel

    from trainer.models.encoder import MeanPooling

    class Pooled(MeanPooling, BertModel):  # mean pooling over the mask, as the task needs
        pass

    model = Pooled.from_pretrained(pretrained, add_pooling_layer=False, dtype=torch.float32)
    return whole_batch(model, files)


@pytest.fixture(scope="module")
def one_process(
    files: dict[str, Path], pretrained: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """24x1, 4x6 and 3x8 with step=cached; 24x1 with the step chosen by itself (one
    micro-batch on one process: the default step, its loss at once); 4x6 of the pretrained
    directory."""
    root = tmp_path_factory.mktemp("one_process")
    splits = {"24x1": (24, 1, True), "4x6": (4, 6, True), "3x8": (3, 8, True)}
    splits["24x1_default"] = (24, 1, False)
    models: dict[str, list[str] | None] = {"pretrained_4x6": from_directory(pretrained)}
    splits["pretrained_4x6"] = (4, 6, True)
    for name, (micro, accum, cached) in splits.items():
        args = one_sgd_step(files, root / name, micro, accum, cached, models.get(name))[:-1]
        train_in_process(args, root / name)
    return {name: root / name for name in splits}


@pytest.fixture(scope="module")
def two_ranks(
    files: dict[str, Path], pretrained: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """DDP 2 ranks x micro 3 x accum 4, FSDP2 2 ranks x micro 4 x accum 3, and DDP 3x4 of the
    pretrained directory, launched together (rank 0's console kept as `console.txt`)."""
    root = tmp_path_factory.mktemp("two_ranks")
    runs = {
        "ddp_3x4": one_sgd_step(files, root / "ddp_3x4", 3, 4),
        "fsdp_4x3": [*one_sgd_step(files, root / "fsdp_4x3", 4, 3), "dist.strategy=fsdp"],
        "pretrained_ddp_3x4": one_sgd_step(
            files, root / "pretrained_ddp_3x4", 3, 4, model=from_directory(pretrained)
        ),
    }
    results = launch_all({name: torchrun(2, args) for name, args in runs.items()}, TIMEOUT)
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
        (root / name / "console.txt").write_text(proc.stdout)
    return {name: root / name for name in runs}


def relative_errors(run_dir: Path, reference: dict[str, Any]) -> tuple[float, float]:
    """(encoder, temperature): |update - (-lr x reference gradient)| / |lr x gradient|."""
    saved = torch.load(run_dir / "checkpoints" / "step_00000001" / "state.pt", weights_only=True)
    weights, initial, grad = saved["model"], reference["initial"], reference["grad"]
    assert set(weights) == set(grad), sorted(set(weights) ^ set(grad))

    def error(names: list[str]) -> float:
        moved = torch.cat([(weights[n].double() - initial[n].double()).flatten() for n in names])
        want = torch.cat([(-LR * grad[n]).flatten() for n in names])
        return ((moved - want).norm() / want.norm()).item()

    encoder = [n for n in grad if n != TEMPERATURE]
    return error(encoder), error([TEMPERATURE])


def first_loss(run_dir: Path) -> float:
    return train_records(read_metrics(run_dir))[0]["train/loss"]


@pytest.mark.parametrize("split", ["24x1", "4x6", "3x8", "24x1_default"])
def test_one_sgd_step_is_the_whole_batch_gradient(
    split: str, one_process: dict[str, Path], reference: dict[str, Any]
) -> None:
    encoder, temperature = relative_errors(one_process[split], reference)
    assert encoder <= 1e-5, f"{split}: encoder update off by {encoder:.2e} (relative)"
    assert temperature <= 1e-5, f"{split}: temperature update off by {temperature:.2e}"
    assert abs(first_loss(one_process[split]) - reference["loss"]) <= 1e-5 * reference["loss"]


@pytest.mark.multiproc
@pytest.mark.parametrize("run", ["ddp_3x4", "fsdp_4x3"])
def test_two_ranks_step_is_the_whole_batch_gradient(
    run: str, two_ranks: dict[str, Path], reference: dict[str, Any]
) -> None:
    """The gather's gradient summed over ranks (1/world of it otherwise) and the temperature's
    summed once over ranks and micro-batches (world x accumulation times otherwise)."""
    encoder, temperature = relative_errors(two_ranks[run], reference)
    assert encoder <= 1e-5, f"{run}: encoder update off by {encoder:.2e} (relative)"
    assert temperature <= 1e-5, f"{run}: temperature update off by {temperature:.2e}"
    assert abs(first_loss(two_ranks[run]) - reference["loss"]) <= 1e-5 * reference["loss"]
    # The step's phases are timed as step=accumulate's are: its gather and gradient sync as
    # `sync` (time/*: the slowest rank's seconds, and which rank that was).
    (record,) = [r for r in read_metrics(two_ranks[run]) if "train/loss" in r]
    for phase in ("data", "compute", "sync", "optimizer"):
        assert record[f"time/{phase}_s"] >= 0 and record[f"time/{phase}_rank"] in (0, 1), record
    assert record["time/sync_s"] > 0, record


def test_a_pretrained_directory_trains_with_its_own_dropout(
    one_process: dict[str, Path], pretrained_reference: dict[str, Any]
) -> None:
    """model=hf_encoder model.pretrained=DIR, naming no model.config field: DIR's config.json
    says dropout 0.0, so one SGD step (4x6) is the dropout-free whole-batch gradient. The
    in-tree yaml's random-init 0.1 was applied over it before (0.54 relative off); the saved
    config holds none of the yaml's defaults."""
    run = one_process["pretrained_4x6"]
    encoder, temperature = relative_errors(run, pretrained_reference)
    assert encoder <= 1e-5, f"encoder update off by {encoder:.2e} (relative)"
    assert temperature <= 1e-5, f"temperature update off by {temperature:.2e}"
    want = pretrained_reference["loss"]
    assert abs(first_loss(run) - want) <= 1e-5 * want
    saved = torch.load(run / "checkpoints" / "step_00000001" / "state.pt", weights_only=True)
    assert saved["config"]["model"]["config"] == {}, saved["config"]["model"]


@pytest.mark.multiproc
def test_a_pretrained_directory_trains_alike_on_two_ranks(
    one_process: dict[str, Path],
    two_ranks: dict[str, Path],
    pretrained_reference: dict[str, Any],
    pretrained: Path,
) -> None:
    """The same directory on 2 ranks (DDP 3x4): the same dropout-free step, and the same
    validation loss as one process (5.5e-4 apart before: each split drew other dropout masks
    of the yaml's 0.1). The start-up line says the dropout in force and whose it is."""
    run = two_ranks["pretrained_ddp_3x4"]
    encoder, temperature = relative_errors(run, pretrained_reference)
    assert encoder <= 1e-5, f"encoder update off by {encoder:.2e} (relative)"
    assert temperature <= 1e-5, f"temperature update off by {temperature:.2e}"
    one, two = validation(one_process["pretrained_4x6"]), validation(run)
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6), (one, two)
    console = (run / "console.txt").read_text()
    assert f"(from {pretrained}, dropout 0.0: the directory's)" in console, console
    random_init = (two_ranks["ddp_3x4"] / "console.txt").read_text()
    assert "(random init, dropout 0.0)" in random_init, random_init


def test_throughput_is_named_by_the_tasks_items(one_process: dict[str, Path]) -> None:
    """A contrastive run's loss items are pairs: the record says `train/pairs_per_s` (24 pairs
    a step over the step's time), not `train/tokens_per_s`; the run's report finds it for its
    throughput chart and its run line."""
    from trainer.tracking.report import charts, load_run, run_line

    run_dir = one_process["3x8"]
    (record,) = train_records(read_metrics(run_dir))
    assert "train/tokens_per_s" not in record
    per_step = record["train/pairs_per_s"] * record["train/step_time_ms"] / 1000
    assert per_step == pytest.approx(N_TRAIN, rel=1e-9)
    run = load_run(run_dir, "3x8")
    (chart,) = [c for c in charts([run]) if c.title.startswith("Throughput")]
    assert [line.metric for line in chart.lines] == ["train/pairs_per_s"]
    assert "median items/s" in run_line(run)


def test_temperature_gradient_is_counted_once(
    one_process: dict[str, Path], reference: dict[str, Any]
) -> None:
    """With 8 micro-batches the temperature moves by exactly -lr x its gradient: a step that
    gave it a gradient per micro-batch (open_clip's --accum-freq, issues #761 and #957) would
    move it 8 times as far, one that forgot it would not move it."""
    grad = reference["grad"][TEMPERATURE].item()
    assert abs(LR * grad) > 0.1, "the reference's temperature gradient is too small to tell"
    saved = torch.load(
        one_process["3x8"] / "checkpoints" / "step_00000001" / "state.pt", weights_only=True
    )
    moved = (saved["model"][TEMPERATURE] - reference["initial"][TEMPERATURE]).item()
    ratio = moved / (-LR * grad)
    assert abs(ratio - 1) <= 1e-5, f"the temperature moved {ratio:.6f} x -lr x its gradient"
    record = train_records(read_metrics(one_process["3x8"]))[0]
    tau = torch.exp(-saved["model"][TEMPERATURE]).item()
    assert record["train/temperature"] == pytest.approx(tau, rel=1e-6)  # after the update


def validation_reference(run_dir: Path, files: dict[str, Path]) -> dict[str, float]:
    """`val/loss` and `val/accuracy@1` of the step-1 checkpoint, computed here in float64:
    every evaluation batch of `EVAL_BATCH` pairs (7 and 1) whole, its pairs each other's
    negatives, whatever the world size of the run."""
    from trainer.data.pairs import pairs_data
    from trainer.models.encoder import encoder

    saved = torch.load(run_dir / "checkpoints" / "step_00000001" / "state.pt", weights_only=True)
    weights = dict(saved["model"])
    task = ContrastiveTask(temperature=0.05, learn_temperature=True, symmetric=True)
    assert task.scale is not None
    task.scale.log_scale.data = weights.pop(TEMPERATURE).double()
    model = encoder(config=TINY_BERT).double().eval()
    model.load_state_dict(weights)
    data = pairs_data(str(files["train"]), str(files["val"]), tokenizer=str(files["tokenizer"]))
    assert len(data.val) == N_VAL and data.collate_fn is not None
    loss = hits = 0.0
    with torch.no_grad():
        for start in range(0, N_VAL, EVAL_BATCH):
            pairs = [data.val[i] for i in range(start, min(start + EVAL_BATCH, N_VAL))]
            reps = task.represent(model, data.collate_fn(pairs))
            n = reps.shape[0]
            loss += task.window_loss(reps, slice(0, n)).item()
            nearest = (reps[:, 0] @ reps[:, 1].T).argmax(dim=-1)
            hits += (nearest == torch.arange(n)).sum().item()
    return {"val/loss": loss / N_VAL, "val/accuracy@1": hits / N_VAL}


def validation(run_dir: Path) -> dict[str, Any]:
    (record,) = [r for r in read_metrics(run_dir) if "val/loss" in r]
    return record


@pytest.mark.multiproc
@pytest.mark.parametrize("run", ["24x1", "ddp_3x4", "fsdp_4x3"])
def test_evaluation_batch_is_whole_on_any_world_size(
    run: str, one_process: dict[str, Path], two_ranks: dict[str, Path], files: dict[str, Path]
) -> None:
    """Each evaluation batch's pairs are negatives of each other on 2 ranks as on one process
    (the batch's representations gathered over the ranks, as training gathers them): each rank
    taking only its own pairs as negatives reported a loss 4x lower on 2 ranks than on one."""
    run_dir = {**one_process, **two_ranks}[run]
    record, want = validation(run_dir), validation_reference(run_dir, files)
    assert record["val/items"] == N_VAL, record
    assert record["val/loss"] == pytest.approx(want["val/loss"], rel=1e-5), (record, want)
    assert record["val/accuracy@1"] == want["val/accuracy@1"], (record, want)


@pytest.mark.multiproc
@pytest.mark.launches
def test_compare_calls_one_process_and_two_ranks_the_same(
    one_process: dict[str, Path], two_ranks: dict[str, Path]
) -> None:
    """`trainer.compare` of the one-process run and the 2-rank runs: the same, validation
    included (it called two runs that trained identically 77% apart)."""
    for run in ("ddp_3x4", "fsdp_4x3"):
        args = [str(one_process["24x1"]), str(two_ranks[run])]
        proc = run_cli(args, module="trainer.compare", timeout=60)
        assert proc.returncode == 0, f"{run}\n{proc.stdout}\n{proc.stderr}"
        assert "val/loss" in proc.stdout and "val/accuracy@1" in proc.stdout, proc.stdout


# ------------------------------------------------------------------- random state, precision


@pytest.mark.parametrize(
    "extra",
    [[], ["train.precision=bf16", "model.activation_checkpointing=true"]],
    ids=["fp32", "bf16_checkpointed"],
)
def test_pass_two_replays_pass_one_bit_for_bit(
    files: dict[str, Path], tmp_path: Path, extra: list[str]
) -> None:
    """Dropout 0.1: each micro-batch's representations in pass 2 equal pass 1's bit for bit
    (the random state replayed); test_dropout_masks_differ_without_replay is the control."""
    calls = tmp_path / "calls.pt"
    overrides = [
        *contrastive(files, dropout=0.1),
        "task._target_=tests.cached_support.RecordingContrastive",
        f"+task.path={calls}",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=3",
        "train.max_steps=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        *extra,
    ]
    train_in_process(overrides, tmp_path / "run")
    recorded = torch.load(calls, weights_only=True)
    assert [c["grad"] for c in recorded] == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    for step in range(2):
        first, second = recorded[6 * step : 6 * step + 3], recorded[6 * step + 3 : 6 * step + 6]
        for i, (a, b) in enumerate(zip(first, second)):
            assert torch.equal(a["reps"], b["reps"]), f"step {step + 1}, micro-batch {i + 1}"


def test_dropout_masks_differ_without_replay(files: dict[str, Path], tmp_path: Path) -> None:
    """The control for the bitwise test: the encoder with dropout 0.1 gives different
    representations of the same batch from two random states."""
    from trainer.data.pairs import pairs_data
    from trainer.models.encoder import encoder

    torch.manual_seed(0)
    model = encoder(config={**TINY_BERT, "hidden_dropout_prob": 0.1}).train()
    data = pairs_data(str(files["train"]), str(files["val"]), tokenizer=str(files["tokenizer"]))
    assert data.collate_fn is not None
    batch = data.collate_fn([data.train[i] for i in range(4)])
    task = ContrastiveTask()
    with torch.no_grad():
        state = torch.get_rng_state()
        a = task.represent(model, batch)
        b = task.represent(model, batch)
        torch.set_rng_state(state)
        c = task.represent(model, batch)
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


# -------------------------------------------------------------- kill -9, resume, auto micro


def kill_at(step: int, marker: Path) -> list[str]:
    return [
        "+callbacks.kill._target_=tests.ckpt_support.KillOnce",
        f"+callbacks.kill.step={step}",
        f"+callbacks.kill.marker={marker}",
    ]


@pytest.mark.launches
def test_sigkill_and_rerun_continue_bit_for_bit(files: dict[str, Path], tmp_path: Path) -> None:
    """Dropout, a learned temperature, AdamW: killed with SIGKILL after step 3 (checkpoints
    every 2 steps) and rerun with the same command, the run repeats steps 3-4 bit for bit:
    losses, gradient norms, temperatures and evaluations equal an uninterrupted run's."""
    args = [
        *contrastive(files, dropout=0.1),
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
        "train.max_steps=4",
        "train.log_every=1",
        "eval.every_steps=3",
        "checkpoint.every_steps=2",
        "optim.lr=0.01",
    ]
    marker = tmp_path / "kill.marker"
    cmds = {
        "whole": python_cmd("trainer.train", *args, f"hydra.run.dir={tmp_path / 'whole'}"),
        "killed": python_cmd(
            "trainer.train", *args, *kill_at(3, marker), f"hydra.run.dir={tmp_path / 'killed'}"
        ),
    }
    results = launch_all(cmds, TIMEOUT)
    assert results["whole"].returncode == 0, explain(results["whole"])
    assert results["killed"].returncode == -9, explain(results["killed"])
    assert marker.exists()
    again = launch_all({"rerun": cmds["killed"]}, TIMEOUT)["rerun"]
    assert again.returncode == 0, explain(again)
    assert "resum" in again.stdout.lower(), again.stdout
    whole, rerun = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "killed")
    keys = ("train/loss", "train/grad_norm", "train/temperature")
    want = [(r["step"], *[r[k] for k in keys]) for r in train_records(whole)]
    got = [(r["step"], *[r[k] for k in keys]) for r in train_records(rerun)]
    assert [g[0] for g in got] == list(range(1, 5)), got
    assert got == want
    vals = [(r["step"], r["val/loss"], r["val/accuracy@1"]) for r in whole if "val/loss" in r]
    assert vals == [
        (r["step"], r["val/loss"], r["val/accuracy@1"]) for r in rerun if "val/loss" in r
    ]
    assert len({w[1] for w in want}) == 4, "the loss does not move"


def auto_args(files: dict[str, Path], micro: Any, *extra: str) -> list[str]:
    return [
        *contrastive(files),
        "model._target_=tests.cached_support.limited_encoder",
        "train.global_batch_size=24",
        f"train.micro_batch_size={micro}",
        "train.max_steps=2",
        "train.log_every=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        *extra,
    ]


def test_auto_micro_batch_sizes_pass_two(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pass 2 runs out of memory above 5 pairs (pass 1 never: no activations): the probe
    chooses 4 of the divisors of 24 and the run equals one at micro-batch 4 set by hand. After
    step 1 the limit drops to 2: step 2's window is redone at 2, and the run stays within
    float rounding of the hand run (the same gradient, another split)."""
    lower = ["+callbacks.lower._target_=tests.cached_support.LowerLimit"]
    lower += ["+callbacks.lower.at_step=1", "+callbacks.lower.fit=2"]
    train_in_process(auto_args(files, "auto", "+model.fit=5", *lower), tmp_path / "auto")
    out = capsys.readouterr()
    assert "chose 4 of the divisors of the per-rank batch 24" in out.out, out.out
    assert "redoing step 2 with micro-batch 2" in out.err, out.err
    train_in_process(auto_args(files, 4), tmp_path / "hand")
    auto = train_records(read_metrics(tmp_path / "auto"))
    hand = train_records(read_metrics(tmp_path / "hand"))
    assert auto[0]["train/loss"] == hand[0]["train/loss"]
    assert auto[0]["train/grad_norm"] == hand[0]["train/grad_norm"]
    for a, h in zip(auto, hand):
        assert a["train/loss"] == pytest.approx(h["train/loss"], rel=1e-6)
        assert a["train/temperature"] == pytest.approx(h["train/temperature"], rel=1e-6)
    assert [r["train/micro_batch_size"] for r in auto] == [4, 2]


# ------------------------------------------------------------------------------ refusals


def test_other_steps_are_refused_for_a_loss_of_the_whole_window(
    files: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="SAMStep would see one micro-batch at a time"):
        train_in_process([*contrastive(files), "step=sam"], tmp_path / "sam")


def test_cached_step_needs_a_loss_of_the_whole_window(tmp_path: Path, tiny: list[str]) -> None:
    text = stdlib_text(tmp_path / "text.txt", 20_000)
    with pytest.raises(ConfigError, match="step=cached needs a task whose loss is of the whole"):
        train_in_process([*tiny, "step=cached", f"data.path={text}"], tmp_path / "lm")


def test_window_task_example_runs() -> None:
    """The `Example::` of `WindowTask`'s docstring runs: its task is a `WindowTask`, and its
    loss over a partition of the rows is the whole window's."""
    import doctest

    import engine.window_task

    result = doctest.testmod(engine.window_task)
    assert result.attempted >= 8 and result.failed == 0


def test_split_layouts_refuse_the_cached_step() -> None:
    """dist.pp, dist.tp and dist.cp run the window as step=accumulate's: each refuses
    step=cached in one paragraph naming `step`."""
    from engine.distributed import DistInfo
    from engine.parallel.base import LayoutError, MeshSplit, RunShape
    from engine.parallel.context import ContextParallel
    from engine.parallel.ddp import DataParallel
    from engine.steps.cached import CachedStep

    shape = RunShape(step=CachedStep(), plain_accumulation=False)
    for key in ("dist.pp", "dist.tp"):
        split = MeshSplit.__new__(MeshSplit)
        split.key = key
        with pytest.raises(LayoutError, match="CachedStep") as info:
            split.check(shape)
        assert info.value.key == "step" and "\n" not in str(info.value)
    cp = ContextParallel.__new__(ContextParallel)
    cp.inner = DataParallel(DistInfo())
    with pytest.raises(LayoutError, match="CachedStep") as info:
        cp.check(shape)
    assert info.value.key == "step"


def test_every_bad_pair_row_is_named_in_one_paragraph(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """16 bad rows of 30 (a missing field, a line that is not JSON, a number for a text,
    13 rows without an anchor): one paragraph naming the first 10 as FILE:LINE in file order,
    counting the other 6; no token shard is left."""
    rows = [json.dumps(r) for r in pairs(30)]
    rows[1] = json.dumps({"anchor": "w3"})  # line 2
    rows[4] = '{"anchor": "w1", "positive": '  # line 5
    rows[6] = json.dumps({"anchor": "w1", "positive": 7})  # line 7
    for i in range(9, 22):  # lines 10-22
        rows[i] = json.dumps({"positive": "w4"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as info:
        overrides = [f"data.path={bad}", f"data.cache_dir={cache}", "data.tokenize_workers=2"]
        train_in_process([*contrastive(files), *overrides], tmp_path / "run")
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"data.path: 16 rows of {bad}"), text
    named = [int(n) for n in re.findall(r"bad\.jsonl:(\d+)", text)]
    assert named == [2, 5, 7, *range(10, 17)], text
    assert text.endswith(
        "and 6 more bad rows. Set data.positive_field= the field holding the "
        "text. Set data.anchor_field= the field holding the text."
    ), text
    assert (
        "no field 'positive'" in text and "is not JSON" in text and "is not a text: 7 (int)" in text
    ), text
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def test_max_length_is_the_models_own_limit(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data=pairs without data.max_length: a 64-position pretrained BERT trains at 64 tokens
    (refused at 128 before); a 600-position one keeps a 600-word text to 512 tokens (cut at
    128 before, with no word); model.config's positions without a directory; the start-up
    line says where the number comes from."""
    from trainer.data.pairs import pairs_data
    from trainer.models.encoder import encoder

    def bert(name: str, positions: int) -> Path:
        folder = tmp_path / name
        encoder(config={**TINY_BERT, "max_position_embeddings": positions}).save_pretrained(folder)
        return write_tokenizer(folder)

    short = bert("short", 64)
    overrides = contrastive(files, model=from_directory(short))
    overrides = [o for o in overrides if not o.startswith("data.tokenizer=")]
    steps = ["train.max_steps=1", "train.micro_batch_size=4", "train.grad_accum_steps=1"]
    records = train_in_process([*overrides, *steps, "eval.every_steps=0"], tmp_path / "run")
    assert train_records(records)
    out = capsys.readouterr().out
    assert f"max_length 64 from the positions of model.pretrained={short}" in out, out

    long = bert("long", 600)
    rows = tmp_path / "long.jsonl"
    rows.write_text(json.dumps({"anchor": " ".join(["w1"] * 600), "positive": "w2"}) + "\n")
    data = pairs_data(str(rows), str(files["val"]), tokenizer=str(long), pretrained=str(long))
    assert data.seq_len == 512 and len(data.train[0]["anchor"]) == 512
    assert "max_length 512 from the positions of model.pretrained=" in data.description
    assert "600, capped at 512" in data.description and "1 texts cut" in data.description
    data = pairs_data(str(rows), str(files["val"]), tokenizer=str(long), context=48)
    assert data.seq_len == 48 and len(data.train[0]["anchor"]) == 48
    assert "from model.config.max_position_embeddings" in data.description


def test_pairs_are_tokenized_once_into_a_cache(files: dict[str, Path], tmp_path: Path) -> None:
    """data=pairs tokenizes into token shards once: a second start reuses them (one build
    logged) and reads the same ids, the tokenizer's own encoding cut to max_length; another
    max_length, another tokenizer or an edited file is tokenized again."""
    from tokenizers import Tokenizer

    from trainer.data.pairs import pairs_data

    train = tmp_path / "train.jsonl"
    train.write_text(files["train"].read_text())
    cache = tmp_path / "cache"

    def start(tokenizer: Path = files["tokenizer"], max_length: int = 6) -> Any:
        return pairs_data(
            str(train),
            str(files["val"]),
            tokenizer=str(tokenizer),
            max_length=max_length,
            cache_dir=str(cache),
        )

    first, again = start(), start()
    assert "tokenized into" in first.description, first.description
    assert "token cache reused" in again.description, again.description
    logs = sorted(cache.rglob("builds.log"))
    assert len(logs) == 2 and all(len(log.read_text().splitlines()) == 1 for log in logs)
    tok = Tokenizer.from_file(str(files["tokenizer"] / "tokenizer.json"))
    tok.enable_truncation(6)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    for i, row in enumerate(rows):
        for side in ("anchor", "positive"):
            assert again.train[i][side].tolist() == tok.encode(row[side]).ids, (i, side)
    assert first.train[5]["positive"].tolist() == again.train[5]["positive"].tolist()
    assert "tokenized into" in start(max_length=7).description
    other = write_tokenizer(tmp_path / "other")
    (other / "tokenizer.json").write_text(
        (other / "tokenizer.json").read_text().replace('"w0"', '"w00"')
    )
    assert "tokenized into" in start(tokenizer=other).description
    train.write_text(train.read_text() + json.dumps({"anchor": "w1", "positive": "w2"}) + "\n")
    edited = start()
    assert "tokenized into" in edited.description and len(edited.train) == len(rows) + 1


# ----------------------------------------------------------------- pretrained dir, export


def run_export(checkpoint: Path, out: Path, *overrides: str) -> None:
    """scripts/export_hf.py's `main`, in this process."""
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("export_hf", REPO / "scripts" / "export_hf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([f"checkpoint={checkpoint}", f"out={out}", *overrides])


def test_pretrained_directory_trains_and_exports_as_an_encoder(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """model.pretrained=DIR (a save_pretrained BERT with its tokenizer.json; data=pairs
    tokenizes with it by default) trains 2 steps with a learned temperature; trainer.evaluate
    on the run gives its validation figures; scripts/export_hf.py writes a directory that
    AutoModel and AutoTokenizer load, whose mean-pooled embeddings equal the trained model's,
    without the temperature. (sentence-transformers loads it: scripts/bench_cached.py.)"""
    from transformers import AutoModel, AutoTokenizer

    from trainer.models.encoder import encoder

    pretrained = tmp_path / "pretrained"
    torch.manual_seed(0)
    encoder(config=TINY_BERT).save_pretrained(pretrained)
    write_tokenizer(pretrained)
    overrides = [
        *contrastive(files, model=from_directory(pretrained)),
        "data.tokenizer=${oc.select:model.pretrained,null}",  # the config's default
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
        "train.max_steps=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=2",
        "optim.lr=0.01",
    ]
    records = train_in_process([*overrides, "eval.every_steps=2"], tmp_path / "run")
    from trainer.api import evaluate

    # trainer.evaluate (the temperature loads too); the run's own paths, as a user names them.
    again = evaluate(tmp_path / "run", saved_paths=True)
    (last,) = [r for r in records if "val/loss" in r]
    assert again["val/loss"] == pytest.approx(last["val/loss"], rel=1e-6), again
    assert again["val/accuracy@1"] == last["val/accuracy@1"]

    # A checkpoint of an earlier version saved the yaml's whole model.config beside
    # model.pretrained (shapes included): it still evaluates (the directory decides them).
    def as_before(state: dict[str, Any]) -> None:
        state["config"]["model"]["config"] = {**TINY_BERT, "hidden_dropout_prob": 0.1}

    step2 = tmp_path / "run" / "checkpoints" / "step_00000002"
    earlier = evaluate(rewrite_state(step2, tmp_path / "earlier", as_before), saved_paths=True)
    assert earlier["val/loss"] == again["val/loss"], (earlier, again)
    out = tmp_path / "export"
    run_export(tmp_path / "run", out, f"model.pretrained={pretrained}")
    from safetensors.torch import load_file

    assert not [k for k in load_file(out / "model.safetensors") if "log_scale" in k]
    saved = torch.load(
        tmp_path / "run" / "checkpoints" / "step_00000002" / "state.pt", weights_only=True
    )["model"]
    trained = encoder(pretrained=str(pretrained)).eval()
    trained.load_state_dict({k: v for k, v in saved.items() if k != TEMPERATURE})
    texts = ["w1 w2 w3", "w4 w5", "w9 w8 w7 w6 w5"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0].item() == tokenizer.cls_token_id
    loaded = AutoModel.from_pretrained(out).eval()
    with torch.no_grad():
        hidden = loaded(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        theirs = (hidden * mask).sum(1) / mask.sum(1)
        ours = trained(batch["input_ids"], batch["attention_mask"])
    assert torch.allclose(theirs, ours, atol=1e-6), (theirs - ours).abs().max()
    assert not torch.allclose(ours, encoder(pretrained=str(pretrained)).eval()(**batch))


def test_a_bert_with_its_pooler_loads_without_a_report(tmp_path: Path) -> None:
    """A BERT directory with its pooler, as BERT checkpoints come: model=hf_encoder builds no
    pooler and says nothing of the pooler weights it leaves (transformers' load report, a
    warning of its logger, named them at every start and export); another weight that fits
    nothing is still reported."""
    import logging
    import logging.handlers

    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    from trainer.models.encoder import encoder

    folder = tmp_path / "bert"
    BertModel(BertConfig(**TINY_BERT)).save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    assert any(k.startswith("pooler.") for k in weights)
    said = logging.handlers.BufferingHandler(capacity=1000)
    logging.getLogger("transformers").addHandler(said)  # the library's root: propagates none
    try:
        model = encoder(pretrained=str(folder))
        quiet = [r.getMessage() for r in said.buffer]
        save_file({**weights, "extra.weight": torch.zeros(2)}, folder / "model.safetensors")
        said.buffer.clear()
        encoder(pretrained=str(folder))
        loud = [r.getMessage() for r in said.buffer]
    finally:
        logging.getLogger("transformers").removeHandler(said)
    assert not [m for m in quiet if "LOAD REPORT" in m or "pooler.dense" in m], quiet
    assert not [n for n, _ in model.named_parameters() if "pooler" in n]
    (report,) = [m for m in loud if "LOAD REPORT" in m]
    assert "extra.weight" in report and "pooler.dense" not in report, report


class BatchNormEncoder(torch.nn.Module):
    """Token embeddings, mean over the mask, BatchNorm over the rows (running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        return self.norm((self.emb(input_ids) * mask).sum(1) / mask.sum(1))


def test_batchnorm_statistics_are_updated_once_per_micro_batch(files: dict[str, Path]) -> None:
    """BatchNorm's running statistics after a step=cached window of 3 micro-batches equal
    3 training forwards of those micro-batches: pass 2 runs them again, and its updates are
    undone (as step=accumulate, statistics per micro-batch)."""
    from engine.distributed import DistInfo
    from engine.numerics.precision import Precision
    from engine.step import StepContext
    from engine.steps.cached import CachedStep
    from trainer.data.pairs import pairs_data

    data = pairs_data(str(files["train"]), str(files["val"]), tokenizer=str(files["tokenizer"]))
    assert data.collate_fn is not None
    window = [data.collate_fn([data.train[i] for i in range(j, j + 4)]) for j in (0, 4, 8)]
    torch.manual_seed(0)
    model = BatchNormEncoder()
    by_hand = BatchNormEncoder()
    by_hand.load_state_dict(model.state_dict())
    with torch.no_grad():
        for batch in window:
            n = batch["input_ids"].shape[0]
            by_hand(batch["input_ids"].view(2 * n, -1), batch["attention_mask"].view(2 * n, -1))
    ctx = StepContext(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        scheduler=None,
        task=ContrastiveTask(),  # type: ignore[arg-type]
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
    )
    CachedStep()(ctx, window)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        got, want = getattr(model.norm, name), getattr(by_hand.norm, name)
        assert torch.equal(got, want), name
    assert int(model.norm.num_batches_tracked) == 3


class MeanEncoder(torch.nn.Module):
    """Token embeddings, a linear layer, mean over the mask: a tiny encoder for the step's
    unit checks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(self.emb.weight.dtype)
        pooled = (self.emb(input_ids) * mask).sum(1) / mask.sum(1)
        return self.proj(pooled)


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_low_precision_gradients_are_the_whole_batch_gradient(
    files: dict[str, Path], mode: str
) -> None:
    """Under fp16 (GradScaler: the window's loss, the cached gradient and pass 2 all carry the
    loss scale, unscaled together) and bf16, the encoder's and the temperature's gradients
    equal fp32's to low-precision rounding, not off by the loss scale or the accumulation."""
    from engine.distributed import DistInfo
    from engine.numerics.precision import Precision
    from engine.step import StepContext
    from engine.steps.cached import CachedStep
    from engine.window_task import attach_loss_parameters
    from trainer.data.pairs import pairs_data

    data = pairs_data(str(files["train"]), str(files["val"]), tokenizer=str(files["tokenizer"]))
    assert data.collate_fn is not None
    window = [data.collate_fn([data.train[i] for i in range(j, j + 4)]) for j in range(0, 24, 4)]

    def grads(precision: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = MeanEncoder()
        task = ContrastiveTask(temperature=0.1, learn_temperature=True)
        attach_loss_parameters(model, task, torch.device("cpu"))
        ctx = StepContext(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            scheduler=None,
            task=task,  # type: ignore[arg-type]
            precision=Precision(precision, "cpu"),
            dist=DistInfo(),
        )
        CachedStep(chunk_size=7)(ctx, window)
        return torch.cat([p.grad.flatten() for p in model.parameters()])  # temperature last

    want, got = grads("fp32"), grads(mode)
    assert want[-1].abs() > 0.01  # the temperature's gradient
    error = ((got - want).norm() / want.norm()).item()
    assert error < 2e-2, f"{mode}: gradient off by {error:.2e} (relative)"
    assert abs(got[-1] / want[-1] - 1) < 2e-2, (got[-1], want[-1])
