"""Mixed precision and non-finite gradients: what the loss scaler, clipping and the skip logic
must guarantee.

- bf16 trains, fp16 stays finite, and both log the *unscaled* gradient norm.
- Clipping under GradScaler (scale -> unscale_ -> clip) equals clipping the true gradient.
- A step whose gradient is non-finite leaves parameters and optimizer state bitwise untouched,
  in one process and under DDP when only one rank overflows; enough of them in a row stop the
  run with one clear paragraph and a finite last checkpoint.
- Diagnostics: anomaly detection runs, per-layer norms add up to the total, and a parameter
  cut off from the loss is named.

Huge but finite gradients (whose fp32 sum of squares would overflow) are clipped and applied,
not mistaken for non-finite ones, in fp32 and under GradScaler alike.

References are computed here, independently of the code under test: a float64 copy of the
model with plain autograd and `torch.nn.utils.clip_grad_norm_`, snapshots taken before a step,
or a clean run of the same configuration. Non-finite gradients come from a one-shot tensor hook
(tests/precision_support.py) that poisons exactly one micro-batch on one rank before DDP's
all-reduce, like a real fp16 overflow would.

Runs are kept tiny (gpt_tiny, micro 4, a ~300 kB text file): fp16 autocast on CPU is 4-60x
slower than fp32 (PLATFORM.md), so fp16 runs are a few steps.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.step import StepContext, StepResult
from engine.steps.accumulate import AccumulateStep
from engine.tasks import CausalLMTask
from tests.conftest import (
    CONFIG_DIR,
    TINY,
    read_metrics,
    stdlib_text,
    train_in_process,
    train_records,
)
from tests.precision_support import poison_next_backward
from tests.ranks import explain, launch_all, run_cli, torchrun_cmd
from trainer.models.gpt import GPT
from trainer.run.fit import TrainingDiverged
from trainer.run.optim import build_optimizer

INJECT = "tests.precision_support.InjectNonFinite"
CLI_TIMEOUT = 120.0  # one gpt_tiny CLI launch takes ~5-10 s on 2 busy cores
TORCHRUN_TIMEOUT = 150.0
SMALL = ["train.micro_batch_size=4", "train.grad_accum_steps=1"]
# The shipped optimizer configs, as the trainer reads them (YAML 1.2 floats such as 1e-8).
ADAMW = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "optim" / "adamw.yaml"))
SGD = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "optim" / "sgd.yaml"))


# --------------------------------------------------------------------------- shared setup


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real Python source in one small file: loads in milliseconds."""
    return stdlib_text(tmp_path_factory.mktemp("precision_data") / "text.txt", 300000)


@pytest.fixture(scope="module")
def base(text_file: Path) -> list[str]:
    """TINY with one 4-sample micro-batch per step, on the small text file."""
    return [*TINY, *SMALL, f"data.path={text_file}"]


def finite(x: float | None) -> bool:
    """Records write a non-finite value as null (strict JSON)."""
    return x is not None and math.isfinite(x)


def by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in train_records(records)}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


def checkpoint_states(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every saved checkpoint's shared state, keyed by step (weights_only: plain tensors)."""
    out = {}
    for path in sorted((run_dir / "checkpoints").glob("step_*/state.pt")):
        out[int(path.parent.name.split("_")[1])] = torch.load(path, weights_only=True)
    return out


def nonfinite_tensors(state: dict[str, Any]) -> list[str]:
    return [k for k, v in state.items() if torch.is_tensor(v) and not torch.isfinite(v).all()]


# --------------------------------------------------------------------------- 1. precisions


@pytest.fixture(scope="module")
def fp32_step1_grad_norm(base: list[str], tmp_path_factory: pytest.TempPathFactory) -> float:
    """The fp32 run's step-1 gradient norm: the reference the mixed-precision norms must match."""
    run_dir = tmp_path_factory.mktemp("fp32_ref")
    records = train_records(train_in_process([*base, "train.max_steps=1"], run_dir))
    return records[0]["train/grad_norm"]


def test_bf16_learns_and_logs_unscaled_grad_norm(
    base: list[str], fp32_step1_grad_norm: float, tmp_path: Path
) -> None:
    """bf16 autocast must still train (loss falls) and report the true gradient norm."""
    records = train_records(
        train_in_process([*base, "train.precision=bf16", "train.max_steps=15"], tmp_path)
    )
    losses = [r["train/loss"] for r in records]
    assert len(losses) == 15
    assert all(finite(x) for x in losses), losses
    assert all(r["train/skipped_steps"] == 0 for r in records)
    first, last = losses[0], losses[-1]
    tail = sum(losses[-3:]) / 3
    assert last < first - 0.3 and tail < first - 0.3, f"bf16 did not learn: {losses}"
    norm = records[0]["train/grad_norm"]
    assert norm == pytest.approx(fp32_step1_grad_norm, rel=0.1), (norm, fp32_step1_grad_norm)


def test_fp16_stays_finite_and_logs_unscaled_grad_norm(
    base: list[str], fp32_step1_grad_norm: float, tmp_path: Path
) -> None:
    """fp16 + GradScaler: finite losses, the scale is recorded, and the logged grad norm is the
    unscaled one (a scaled norm would be 65536x the fp32 norm)."""
    records = train_records(
        train_in_process([*base, "train.precision=fp16", "train.max_steps=3"], tmp_path)
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(finite(r["train/loss"]) for r in records), records
    assert all("train/loss_scale" in r for r in records), records[0].keys()
    assert records[0]["train/loss_scale"] == 2.0**16  # GradScaler's default initial scale
    norm = records[0]["train/grad_norm"]
    assert norm == pytest.approx(fp32_step1_grad_norm, rel=0.1), (norm, fp32_step1_grad_norm)


# --------------------------------------------------------------------------- 2. clipping


class SquaredErrorTask:
    """Regression: one loss item per sample, the squared error summed over outputs."""

    def count_items(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.tensor(batch[0].shape[0])

    def loss_sum(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).sum()


@pytest.mark.parametrize("mode", ["fp32", "fp16_scaler"])
def test_clipping_under_grad_scaler_equals_clipping_true_gradient(mode: str) -> None:
    """scale -> unscale_ -> clip must equal clip of the true gradient; the norm reported is the
    true pre-clip norm. fp16 autocast is switched off (`dtype = None`) so that only the
    scaler's order of operations is under test, not fp16 forward numerics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    gen = torch.Generator().manual_seed(1)
    # Micro-batches of different sizes: the window's mean is not the mean of micro means.
    window = [(torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)) for n in (3, 7)]

    # Reference in float64 (exact copy of the fp32 weights): mean loss over all 10 samples.
    ref = copy.deepcopy(model).double()
    loss = sum(((ref(x.double()) - y.double()) ** 2).sum() for x, y in window) / 10
    loss.backward()
    true_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()))
    max_norm = true_norm / 4  # clipping is active: the update shrinks 4x
    ref_before = [p.detach().clone() for p in ref.parameters()]
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    torch.optim.SGD(ref.parameters(), lr=1.0, momentum=0.0).step()
    ref_update = [p.detach() - b for p, b in zip(ref.parameters(), ref_before)]

    precision = Precision("fp16" if mode == "fp16_scaler" else "fp32", "cpu")
    precision.dtype = None  # autocast off: GradScaler's scale/unscale/clip order alone
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    ctx = StepContext(
        model=model,
        optimizer=optimizer,
        scheduler=None,
        task=SquaredErrorTask(),
        precision=precision,
        dist=DistInfo(),
        clip_grad_norm=max_norm,
    )
    before = [p.detach().clone() for p in model.parameters()]
    result = AccumulateStep()(ctx, window)
    update = [p.detach().double() - b.double() for p, b in zip(model.parameters(), before)]

    if mode == "fp16_scaler":
        assert precision.scaler is not None and precision.scaler.get_scale() == 2.0**16
    assert float(result.skipped) == 0.0
    assert float(result.grad_norm) == pytest.approx(true_norm, rel=1e-6)
    update_norm = math.sqrt(sum(float(u.pow(2).sum()) for u in update))
    assert update_norm == pytest.approx(max_norm, rel=1e-5), "clipping was not applied"
    scale = max(float(u.abs().max()) for u in ref_update)
    err = max(float((u - r).abs().max()) for u, r in zip(update, ref_update)) / scale
    assert err < 1e-6, f"{mode}: update differs from the clipped fp32 gradient by {err:.2e}"


# --------------------------------------------------------------------------- 3. skip, 1 process


def tiny_gpt_ctx(mode: str) -> StepContext:
    """A tiny GPT with the trainer's fused AdamW, clipping on, in precision `mode`."""
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    optimizer = build_optimizer({**ADAMW, "lr": 1e-2}, model)
    assert optimizer.defaults.get("fused"), "the skip must be tested on the fused AdamW path"
    return StepContext(
        model=model,
        optimizer=optimizer,
        scheduler=None,
        task=CausalLMTask(),
        precision=Precision(mode, "cpu"),
        dist=DistInfo(),
        clip_grad_norm=1.0,
    )


def lm_window(step: int, accum: int = 2, micro: int = 2) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(100 + step)
    window = []
    for _ in range(accum):
        tokens = torch.randint(0, 64, (micro, 17), generator=gen)
        window.append((tokens[:, :-1].clone(), tokens[:, 1:].clone()))
    return window


def snapshot(ctx: StepContext) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    params = [p.detach().clone() for p in ctx.model.parameters()]
    state = [
        {k: v.clone() for k, v in ctx.optimizer.state[p].items()} for p in ctx.model.parameters()
    ]
    return params, state


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_nonfinite_step_leaves_params_and_optimizer_state_bitwise(mode: str) -> None:
    """One poisoned micro-batch at step 4: the update is skipped with parameters, AdamW moments
    and AdamW's step counter bitwise as after step 3; fp16 also halves the loss scale."""
    ctx = tiny_gpt_ctx(mode)
    step_fn = AccumulateStep()
    results: dict[int, StepResult] = {}
    for step in (1, 2, 3):
        results[step] = step_fn(ctx, lm_window(step))
        assert float(results[step].skipped) == 0.0, f"step {step} skipped without injection"
    params, state = snapshot(ctx)
    scale = ctx.precision.scaler.get_scale() if ctx.precision.scaler else None

    poison_next_backward(ctx.model.blocks[0].mlp.fc.weight, "inf")  # micro-batch 1 of 2 only
    results[4] = step_fn(ctx, lm_window(4))
    assert float(results[4].skipped) == 1.0
    assert not math.isfinite(float(results[4].grad_norm))
    assert math.isfinite(float(results[4].loss_sum)), "the forward was not poisoned"
    after_params, after_state = snapshot(ctx)
    for i, (a, b) in enumerate(zip(params, after_params)):
        assert torch.equal(a, b), f"parameter {i} changed on a skipped step"
    for i, (a, b) in enumerate(zip(state, after_state)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"optimizer state {k!r} of parameter {i} changed"
    if scale is not None:
        assert ctx.precision.scaler.get_scale() == scale / 2

    results[5] = step_fn(ctx, lm_window(5))
    assert float(results[5].skipped) == 0.0
    assert math.isfinite(float(results[5].loss_sum)) and math.isfinite(float(results[5].grad_norm))
    assert not torch.equal(params[0], ctx.model.tok_emb.weight), "step 5 did not update"
    # The skipped step does not count as an Adam step (bias correction stays right).
    assert all(float(ctx.optimizer.state[p]["step"]) == 4.0 for p in ctx.model.parameters())


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_skipped_first_step_with_sgd_momentum_has_no_effect(mode: str) -> None:
    """`optim=sgd` (momentum): a non-finite FIRST step must leave no trace, not even momentum
    buffers (fused SGD would fill them with uninitialized memory), so the next step equals a
    run in which the poisoned step never happened."""
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    twin = copy.deepcopy(model)

    def ctx_for(m: torch.nn.Module) -> StepContext:
        opt = build_optimizer({**SGD, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}, m)
        return StepContext(
            model=m,
            optimizer=opt,
            scheduler=None,
            task=CausalLMTask(),
            precision=Precision(mode, "cpu"),
            dist=DistInfo(),
            clip_grad_norm=1.0,
        )

    ctx, clean = ctx_for(model), ctx_for(twin)
    before = [p.detach().clone() for p in model.parameters()]
    handle = model.blocks[0].mlp.fc.weight.register_hook(lambda g: g * float("inf"))
    try:
        assert float(AccumulateStep()(ctx, lm_window(1)).skipped) == 1.0
    finally:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    AccumulateStep()(ctx, lm_window(2))
    AccumulateStep()(clean, lm_window(2))
    for got, want in zip(model.parameters(), twin.parameters()):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_huge_finite_gradients_are_clipped_not_skipped(mode: str) -> None:
    """|g| ~ 1e21 overflows an fp32 sum of squares; the norm must still be finite, so the step
    is clipped and applied, and the skip decision agrees with GradScaler's own."""
    ctx = tiny_gpt_ctx(mode)
    step_fn = AccumulateStep()
    step_fn(ctx, lm_window(1))
    params, _ = snapshot(ctx)
    weight = ctx.model.blocks[0].mlp.fc.weight
    handle = weight.register_hook(lambda g: g * 1e24)
    try:
        result = step_fn(ctx, lm_window(2))
    finally:
        handle.remove()
    assert float(result.skipped) == 0.0
    norm = float(result.grad_norm)
    assert math.isfinite(norm) and norm > 1e19
    after_params, _ = snapshot(ctx)
    assert all(torch.isfinite(p).all() for p in after_params)
    assert any(not torch.equal(a, b) for a, b in zip(params, after_params)), "step not applied"


def test_skipped_steps_are_counted_and_training_continues(base: list[str], tmp_path: Path) -> None:
    """Through the real trainer: each poisoned step (4 and 6) counts one skip in its record,
    the steps between train on with finite losses, and two skips that are not consecutive do
    not trip train.max_consecutive_skips=2."""
    overrides = [
        *base,
        "train.max_steps=7",
        "train.max_consecutive_skips=2",
        f"+callbacks.inj._target_={INJECT}",
        "+callbacks.inj.step=4",
        "+callbacks.inj.repeat=true",
        "+callbacks.inj.every=2",
    ]
    records = by_step(train_in_process(overrides, tmp_path))
    assert sorted(records) == [1, 2, 3, 4, 5, 6, 7]
    assert [records[s]["train/skipped_steps"] for s in range(1, 8)] == [0, 0, 0, 1, 1, 2, 2]
    for s in range(1, 8):
        assert finite(records[s]["train/loss"]), records[s]
        assert finite(records[s]["train/grad_norm"]) == (s not in (4, 6)), records[s]
        # read_metrics parsed every line strictly; the record names what was not finite.
        assert records[s].get("non_finite", []) == ([] if s not in (4, 6) else ["train/grad_norm"])


# --------------------------------------------------------------------------- 4. one rank overflows


@pytest.mark.multiproc
def test_inf_on_one_rank_skips_the_step_on_every_rank(text_file: Path, tmp_path: Path) -> None:
    """Rank 1 alone overflows in step 3 (first micro-batch, under no_sync): the all-reduce
    spreads the inf, every rank skips, the job finishes, and the ranks stay bitwise equal."""
    args = [
        *TINY,
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
        "train.max_steps=4",
        f"data.path={text_file}",
    ]
    digests = tmp_path / "digests"
    injected = [
        f"+callbacks.inj._target_={INJECT}",
        "+callbacks.inj.step=3",
        "+callbacks.inj.rank=1",
        f"+callbacks.inj.digest_dir={digests}",
    ]
    trainer = [*torchrun_cmd(2), "-m", "trainer.train", *args]
    # The clean reference and the injected run side by side.
    procs = launch_all(
        {
            "clean": [*trainer, f"hydra.run.dir={tmp_path / 'clean'}"],
            "inj": [*trainer, f"hydra.run.dir={tmp_path / 'inj'}", *injected],
        },
        TORCHRUN_TIMEOUT,
    )
    clean, inj = procs["clean"], procs["inj"]
    assert clean.returncode == 0, explain(clean)
    assert inj.returncode == 0, explain(inj)
    ref, got = by_step(read_metrics(tmp_path / "clean")), by_step(read_metrics(tmp_path / "inj"))
    assert sorted(got) == [1, 2, 3, 4]
    assert [got[s]["train/skipped_steps"] for s in range(1, 5)] == [0, 0, 1, 1]
    assert all(r["train/skipped_steps"] == 0 for r in ref.values())
    for s in (1, 2):  # identical until the injection
        assert got[s]["train/loss"] == ref[s]["train/loss"], s
        assert got[s]["train/grad_norm"] == ref[s]["train/grad_norm"], s
    assert not finite(got[3]["train/grad_norm"])
    assert got[3]["train/loss"] == ref[3]["train/loss"], "the forward of step 3 was not poisoned"
    assert finite(got[4]["train/loss"]) and finite(got[4]["train/grad_norm"]), got[4]

    # Both ranks skipped: their parameters agree bitwise after every step, and step 3 left them
    # as step 2 had.
    per_rank = []
    for rank in (0, 1):
        lines = (digests / f"rank{rank}.jsonl").read_text().splitlines()
        per_rank.append({d["step"]: d["digest"] for d in map(json.loads, lines)})
    assert per_rank[0] == per_rank[1]
    assert sorted(per_rank[0]) == [1, 2, 3, 4]
    assert per_rank[0][3] == per_rank[0][2] and per_rank[0][4] != per_rank[0][3]


# --------------------------------------------------------------------------- 5-6. divergence


@pytest.mark.launches
def test_consecutive_nonfinite_steps_stop_with_clear_message(
    base: list[str], tmp_path: Path
) -> None:
    """Every step from 2 on overflows: after train.max_consecutive_skips=3 of them the run stops
    with one paragraph (no traceback), and the checkpoints hold step 1's finite weights."""
    proc = run_cli(
        [
            *base,
            "train.max_steps=10",
            "train.max_consecutive_skips=3",
            "train.log_every=1",
            "checkpoint.every_steps=1",
            f"hydra.run.dir={tmp_path}",
            f"+callbacks.inj._target_={INJECT}",
            "+callbacks.inj.step=2",
            "+callbacks.inj.repeat=true",
        ],
        timeout=CLI_TIMEOUT,
    )
    assert proc.returncode != 0, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, explain(proc)
    assert "step 4" in errors[0] and "train.max_consecutive_skips=3" in errors[0], errors[0]

    records = by_step(read_metrics(tmp_path))
    assert max(records) == 4, "the run went on past the limit"
    assert [records[s]["train/skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 2, 3]
    assert "run diverged: step 4/10" in proc.stdout, explain(proc)
    assert f"train/loss {records[4]['train/loss']:.4f}" in proc.stdout, explain(proc)

    states = checkpoint_states(tmp_path)
    assert states, "no checkpoint saved"
    newest = states[max(states)]
    intact = re.search(r"last checkpoint \(step (\d+)\)", errors[0])
    assert intact and int(intact.group(1)) == max(states), (errors[0], sorted(states))
    assert not nonfinite_tensors(newest["model"])
    # Steps 2 and 3 were both skipped: their checkpoints hold the same (step 1) weights.
    if 2 in states:
        for k, v in newest["model"].items():
            assert torch.equal(v, states[2]["model"][k]), k


def test_absurd_learning_rate_never_writes_nonfinite_weights(
    base: list[str], tmp_path: Path
) -> None:
    """optim.lr=1e4 either trains through or stops with the divergence error; either way no
    checkpoint holds NaN/Inf weights and a non-finite loss is only ever on a skipped step.
    (In-process: the CLI's no-traceback paragraph for this error is checked above.)"""
    overrides = [*base, "train.max_steps=15", "optim.lr=1e4", "checkpoint.every_steps=5"]
    try:
        train_in_process(overrides, tmp_path)
        stopped = None
    except TrainingDiverged as exc:
        stopped = str(exc)
    records = by_step(read_metrics(tmp_path))
    if stopped is None:
        assert sorted(records) == list(range(1, 16))
        assert all(finite(r["train/loss"]) for r in records.values()), records
    else:
        assert "train.max_consecutive_skips=10" in stopped, stopped
        assert f"up to step {max(records)}" in stopped, stopped
    skipped_before = 0
    for step in sorted(records):
        r = records[step]
        newly_skipped = r["train/skipped_steps"] - skipped_before
        skipped_before = r["train/skipped_steps"]
        if not finite(r["train/loss"]):
            assert newly_skipped == 1, f"step {step} has loss {r['train/loss']} but was applied"
    states = checkpoint_states(tmp_path)
    assert states, "no checkpoint saved"
    for step, state in states.items():
        assert not nonfinite_tensors(state["model"]), f"checkpoint {step} holds NaN/Inf weights"


# --------------------------------------------------------------------------- 7-8. diagnostics


def test_detect_anomaly_runs(base: list[str], tmp_path: Path) -> None:
    """The debugging switch must not break a healthy run."""
    was = torch.is_anomaly_enabled()
    try:
        records = train_records(
            train_in_process([*base, "train.max_steps=2", "train.detect_anomaly=true"], tmp_path)
        )
    finally:
        torch.autograd.set_detect_anomaly(was)  # the trainer sets it process-wide
    assert [r["step"] for r in records] == [1, 2]
    assert all(finite(r["train/loss"]) and finite(r["train/grad_norm"]) for r in records)


def test_per_layer_grad_norms_combine_to_total(
    base: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Per-layer norms cover every layer once: their root sum of squares is the total norm.
    A healthy model also draws no missing-gradient warning."""
    records = train_records(
        train_in_process([*base, "train.max_steps=2", "train.grad_norms=per_layer"], tmp_path)
    )
    for r in records:
        layers = {k: v for k, v in r.items() if k.startswith("grad_norm/")}
        assert set(layers) == {
            "grad_norm/tok_emb",
            "grad_norm/pos_emb",
            "grad_norm/blocks.0",
            "grad_norm/blocks.1",
            "grad_norm/ln_f",
        }, sorted(layers)
        combined = math.sqrt(sum(v * v for v in layers.values()))
        assert combined == pytest.approx(r["train/grad_norm"], rel=1e-5), (r["step"], layers)
    assert "received no gradient" not in capsys.readouterr().err


def test_missing_gradient_is_reported_by_name(
    base: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A parameter that requires grad but is cut off from the loss is named after step 1."""
    records = train_records(
        train_in_process(
            [
                *base,
                "train.max_steps=2",
                "step._target_=tests.precision_support.DetachEmbeddingStep",
            ],
            tmp_path,
        )
    )
    assert [r["step"] for r in records] == [1, 2]
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "received no gradient" in line]
    assert len(warnings) == 1, err
    assert "pos_emb.weight" in warnings[0] and "1 parameter(s)" in warnings[0], warnings[0]
