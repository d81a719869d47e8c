"""Step strategies, callbacks and model options beyond plain accumulation: SAM (also under
torchrun), user strategies by `_target_`, EMA and per-layer gradient norms across a crash and
resume, activation checkpointing, torch.compile and fake quantization.

References are independent of the code under test wherever possible: SAM, ASAM and EMA are
recomputed by hand in float64 from their definitions; fake-quantized weights are rebuilt from
the rounding rule; trainer runs are compared with other configurations that must (or must
not) give the same numbers, never with themselves.

Runs are gpt_tiny on a ~200 kB text file (loading all of `stdlib` costs ~2 s per launch), in
this process where possible: a `python -m trainer.train` launch costs ~5 s on 2 busy cores.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from engine.callbacks import CallbackList
from engine.callbacks.ema import EMA
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.step import StepContext
from engine.steps.sam import SAMStep
from tests.conftest import (
    TINY,
    compose_config,
    read_metrics,
    stdlib_text,
    train_in_process,
    train_records,
)
from tests.ranks import explain, run_cli, run_torchrun
from tests.steps_support import CountingStep
from trainer.config.cli import to_config
from trainer.config.errors import ConfigError
from trainer.models.gpt import GPT, FakeQuantLinear, GPTConfig
from trainer.run.assemble import build_model

Records = list[dict[str, Any]]
Runner = Callable[[Sequence[str]], Records]

STEPS = 20
LOSS_ATOL = 1e-5
CLI_TIMEOUT = 120.0  # one gpt_tiny launch takes ~5-10 s on 2 busy cores
TORCHRUN_TIMEOUT = 150.0
COMPILE_TIMEOUT = 400.0  # a cold inductor compile of gpt_tiny: ~35 s CPU, ~60 s on busy cores
# Wall-clock and memory measurements: never reproducible, so never compared.
VOLATILE = {"train/tokens_per_s", "train/step_time_ms", "train/peak_mem_mb", "train/mfu"}


# --------------------------------------------------------------------------- shared setup


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real Python source in one small file: loads in milliseconds."""
    return stdlib_text(tmp_path_factory.mktemp("steps_data") / "text.txt", 200000)


@pytest.fixture(scope="module")
def base(text_file: Path) -> list[str]:
    """TINY on the small file, global batch 16 as micro 16 x accum 1, 20 steps."""
    return [
        *TINY,
        f"data.path={text_file}",
        f"train.max_steps={STEPS}",
        "train.micro_batch_size=16",
        "train.grad_accum_steps=1",
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    """Trains in this process once per distinct override list; tests share the records."""
    cache: dict[tuple[str, ...], Records] = {}

    def _run(args: Sequence[str]) -> Records:
        key = tuple(args)
        if key not in cache:
            cache[key] = train_in_process(list(args), tmp_path_factory.mktemp("run"))
        return cache[key]

    return _run


def losses(records: Records, key: str = "train/loss") -> list[float]:
    return [r[key] for r in train_records(records)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def stable(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its timing and memory fields (the phase times `time/*` too)."""
    return {k: v for k, v in record.items() if k not in VOLATILE and not k.startswith("time/")}


def assert_learns(values: list[float], what: str) -> None:
    """The last loss and the mean of the last three are clearly below the first."""
    first, tail = values[0], sum(values[-3:]) / 3
    assert values[-1] < first - 0.3 and tail < first - 0.3, f"{what} did not learn: {values}"


# --------------------------------------------------------------------------- 1. SAM


def test_sam_learns_and_differs_from_the_default_step(run: Runner, base: list[str]) -> None:
    """SAM trains, and really is another algorithm: same seed, same first loss (both report
    the loss at the same initial weights), different trajectory afterwards."""
    sam = losses(run([*base, "step=sam"]))
    default = losses(run(base))
    assert len(sam) == len(default) == STEPS
    assert_learns(sam, "step=sam")
    assert sam[0] == pytest.approx(default[0], abs=1e-6), (sam[0], default[0])
    diff = max_diff(sam, default)
    assert diff > 1e-2, f"SAM's losses are within {diff:.1e} of plain accumulation's"


def test_sam_is_exact_under_accumulation(run: Runner, base: list[str]) -> None:
    """Both SAM passes use the whole window's gradient, so micro 16 x accum 1 and micro 4 x
    accum 4 log the same losses (a per-micro-batch ascent direction would not)."""
    whole = train_records(run([*base, "step=sam"]))
    split = train_records(
        run([*base, "step=sam", "train.micro_batch_size=4", "train.grad_accum_steps=4"])
    )
    diff = max_diff(losses(whole), losses(split))
    assert diff <= LOSS_ATOL, f"SAM 16x1 vs 4x4: train/loss off by {diff:.2e}"
    for a, b in zip(whole, split):
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)


class SquaredErrorTask:
    """Regression: every output element of every sample is one loss item."""

    def count_items(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.tensor(batch[1].numel())

    def loss_sum(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).sum()


def tiny_mlp() -> nn.Module:
    """Nonlinear, so the gradient at w + e really differs from the one at w."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def regression_window() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two micro-batches of different sizes: the window's mean is not the mean of means."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, generator=gen), torch.randn(n, 2, generator=gen)) for n in (3, 7)]


def mlp_loss(params: list[torch.Tensor], window: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """Mean squared error of the whole window, written out by hand (float64)."""
    w1, b1, w2, b2 = params
    total = sum(
        ((torch.tanh(x.double() @ w1.T + b1) @ w2.T + b2 - y.double()) ** 2).sum()
        for x, y in window
    )
    return total / sum(y.numel() for _, y in window)


def grad_at(params: list[torch.Tensor], window: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    return list(torch.autograd.grad(mlp_loss(leaves, window), leaves))


def sgd_ctx(model: nn.Module, lr: float) -> StepContext:
    """One process, fp32, plain SGD without momentum, no clipping, no scheduler."""
    return StepContext(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0),
        scheduler=None,
        task=SquaredErrorTask(),
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        clip_grad_norm=None,
        callbacks=CallbackList(),
    )


@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_one_sam_step_matches_a_hand_computed_update(adaptive: bool) -> None:
    """SAMStep's update equals the definition, computed here in float64:
    g1 = grad L(w); e = rho g1 / ||g1|| (SAM) or rho |w|^2 g1 / || |w| g1 || (ASAM);
    g2 = grad L(w + e); w_new = w - lr g2. Norms run over all parameters together."""
    rho, lr = 0.05, 0.1
    model = tiny_mlp()
    window = regression_window()
    w = [p.detach().double().clone() for p in model.parameters()]

    g1 = grad_at(w, window)
    if adaptive:
        norm = math.sqrt(sum(float(((wi.abs() * gi) ** 2).sum()) for wi, gi in zip(w, g1)))
        e = [rho * wi.abs() ** 2 * gi / norm for wi, gi in zip(w, g1)]
    else:
        norm = math.sqrt(sum(float((gi**2).sum()) for gi in g1))
        e = [rho * gi / norm for gi in g1]
    g2 = grad_at([wi + ei for wi, ei in zip(w, e)], window)
    expected = [wi - lr * gi for wi, gi in zip(w, g2)]
    plain_sgd = [wi - lr * gi for wi, gi in zip(w, g1)]

    result = SAMStep(rho=rho, adaptive=adaptive)(sgd_ctx(model, lr), window)

    got = [p.detach().double() for p in model.parameters()]
    for name, a, b in zip(["w1", "b1", "w2", "b2"], got, expected):
        err = (a - b).abs().max().item()
        assert err <= 1e-6, f"{name}: SAM update off the hand reference by {err:.2e}"
    # Not vacuous: the SAM update is far from the plain gradient step.
    gap = max((a - b).abs().max().item() for a, b in zip(expected, plain_sgd))
    assert gap > 1e-4, f"reference SAM and SGD updates differ by only {gap:.1e}"
    # The loss reported is the one at w, not at w + e; the norm is that of g2 (pre-clip).
    assert (result.loss_sum / result.global_count).item() == pytest.approx(
        mlp_loss(w, window).item(), rel=1e-6
    )
    g2_norm = math.sqrt(sum(float((gi**2).sum()) for gi in g2))
    assert result.grad_norm.item() == pytest.approx(g2_norm, rel=1e-5)


# --------------------------------------------------------------------------- 2. SAM + DDP


@pytest.mark.multiproc
def test_sam_under_torchrun_matches_one_process(
    base: list[str], run: Runner, tmp_path: Path
) -> None:
    """2 ranks x micro 4 x accum 2 under DDP equal 1 process x micro 8 x accum 2. Both SAM
    passes must keep `no_sync` on all but the last micro-batch and all-reduce once: a missing
    sync would leave each rank with its own half-batch gradient and other numbers."""
    args = [*base, "step=sam", "train.max_steps=6", "train.grad_accum_steps=2"]
    single = train_records(run([*args, "train.micro_batch_size=8"]))
    proc = run_torchrun(
        2,
        [*args, "train.micro_batch_size=4", f"hydra.run.dir={tmp_path}"],
        timeout=TORCHRUN_TIMEOUT,
    )
    assert proc.returncode == 0, explain(proc)
    ddp = train_records(read_metrics(tmp_path))
    assert [r["step"] for r in ddp] == list(range(1, 7)), explain(proc)
    diff = max_diff(losses(single), losses(ddp))
    assert diff <= LOSS_ATOL, f"SAM under DDP: train/loss off by {diff:.2e}\n{explain(proc)}"
    for a, b in zip(single, ddp):
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)


# --------------------------------------------------------------------------- 3. user strategies


def test_user_strategy_by_target_is_used_with_its_kwargs(run: Runner, base: list[str]) -> None:
    """`step._target_` plus `+step.factor=` builds the user's class with that argument, the
    trainer calls it once per optimizer step with the whole window, and (as it delegates to
    exact accumulation) it trains exactly like the default step."""
    CountingStep.calls.clear()
    records = run(
        [
            *base,
            "train.micro_batch_size=8",
            "train.grad_accum_steps=2",
            "step._target_=tests.steps_support.CountingStep",
            "+step.factor=2.5",
        ]
    )
    assert CountingStep.calls == [(2.5, 2)] * STEPS, CountingStep.calls
    default = run([*base, "train.micro_batch_size=8", "train.grad_accum_steps=2"])
    assert [stable(r) for r in train_records(records)] == [
        stable(r) for r in train_records(default)
    ]


@pytest.mark.launches
def test_missing_step_target_is_a_clear_error(text_file: Path, tmp_path: Path) -> None:
    """A `_target_` that does not exist: exit 2 and one paragraph naming `step._target_` and
    the class, no traceback."""
    proc = run_cli(
        [
            *TINY,
            f"data.path={text_file}",
            "step._target_=tests.steps_support.NoSuchStep",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=CLI_TIMEOUT,
    )
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, explain(proc)
    assert "step._target_" in errors[0] and "tests.steps_support.NoSuchStep" in errors[0], errors
    assert not (tmp_path / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- 4. EMA, grad stats


def by_kind(records: Records) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Train and validation records keyed by step; a later occurrence replaces an earlier one
    (a resumed run repeats the steps after its checkpoint)."""
    train: dict[int, dict[str, Any]] = {}
    val: dict[int, dict[str, Any]] = {}
    for r in records:
        if "train/loss" in r:
            train[r["step"]] = stable(r)
        elif "val/loss" in r:
            val[r["step"]] = r
    return train, val


@pytest.mark.launches
def test_ema_and_grad_stats_resume_exactly_after_a_crash(text_file: Path, tmp_path: Path) -> None:
    """SIGKILL at step 6 (checkpoint at 4), rerun the same command: every train record (with
    the per-layer grad norms) and every validation record (with the EMA's loss) equals the
    uninterrupted run's, so EMA state, dropout RNG and data position all resume exactly."""
    args = [
        *TINY,
        f"data.path={text_file}",
        "train.max_steps=12",
        "callbacks=[ema,grad_stats]",
        "model.dropout=0.1",
        "data.packed=false",
        "checkpoint.every_steps=4",
        "eval.every_steps=4",
        "eval.max_batches=4",
        "eval.sample_tokens=0",
    ]
    reference = train_in_process(args, tmp_path / "reference")

    run_dir, marker = tmp_path / "crashed", tmp_path / "killed.marker"
    cmd = [
        *args,
        "+callbacks.kill._target_=tests.steps_support.KillOnce",
        "+callbacks.kill.step=6",
        f"+callbacks.kill.marker={marker}",
        f"hydra.run.dir={run_dir}",
    ]
    first = run_cli(cmd, timeout=CLI_TIMEOUT)
    assert first.returncode == -9, explain(first)  # died by SIGKILL, not an exception
    assert marker.exists()
    second = run_cli(cmd, timeout=CLI_TIMEOUT)
    assert second.returncode == 0, explain(second)
    assert "at step 4" in second.stdout, explain(second)  # resumed from the step-4 checkpoint

    ref_train, ref_val = by_kind(reference)
    got_train, got_val = by_kind(read_metrics(run_dir))
    assert sorted(ref_train) == sorted(got_train) == list(range(1, 13))
    assert sorted(ref_val) == sorted(got_val) == [4, 8, 12]
    layers = {k for k in ref_train[1] if k.startswith("grad_norm/")}
    assert {"grad_norm/blocks.0", "grad_norm/blocks.1", "grad_norm/tok_emb"} <= layers, layers
    assert all("val/loss_ema" in r for r in ref_val.values()), ref_val
    # The EMA really averages: its weights are not the live weights.
    assert ref_val[12]["val/loss_ema"] != ref_val[12]["val/loss"], ref_val[12]
    for step in ref_train:
        assert got_train[step] == ref_train[step], f"train record {step} differs after resume"
    for step in ref_val:
        assert got_val[step] == ref_val[step], f"val record {step} differs after resume"


def test_ema_matches_a_hand_computed_average_and_round_trips(tmp_path: Path) -> None:
    """shadow_n = d_n shadow_{n-1} + (1 - d_n) w_n with d_n = min(decay, (1 + n) / (10 + n))
    (n counted from 0, shadow initialized to the first weights), recomputed here in float64;
    the state survives torch.save / torch.load(weights_only=True) and continues identically;
    `weights_swapped` shows the shadow and restores the live weights bitwise."""
    decay = 0.8
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ctx = SimpleNamespace(model=model)
    ema = EMA(decay=decay, warmup=True)
    gen = torch.Generator().manual_seed(2)

    def fake_step() -> list[torch.Tensor]:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen))
        return [p.detach().double().clone() for p in model.parameters()]

    shadow: list[torch.Tensor] | None = None
    for n in range(6):
        weights = fake_step()
        ema.on_after_optimizer_step(ctx, n + 1)
        d = min(decay, (1 + n) / (10 + n))
        if shadow is None:
            shadow = weights
        else:
            shadow = [d * s + (1 - d) * w for s, w in zip(shadow, weights)]
        assert ema.shadow is not None
        for got, want in zip(ema.shadow, shadow):
            assert (got.double() - want).abs().max().item() <= 1e-6, f"update {n}"
    assert ema.updates == 6

    path = tmp_path / "ema.pt"
    torch.save(ema.state_dict(), path)
    restored = EMA(decay=decay, warmup=True)
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert restored.updates == 6
    fake_step()
    ema.on_after_optimizer_step(ctx, 7)
    restored.on_after_optimizer_step(ctx, 7)
    assert ema.shadow is not None and restored.shadow is not None
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, restored.shadow))

    live = [p.detach().clone() for p in model.parameters()]
    with ema.weights_swapped(model):
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), ema.shadow))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), live))


# --------------------------------------------------------------------------- 5. checkpointing


def test_activation_checkpointing_changes_nothing_but_memory(
    run: Runner, base: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With dropout 0.1, recomputing each block in backward must redraw the same dropout
    masks: records identical to the run without checkpointing. Counting the calls proves the
    checkpointed path ran; a dropout-free run proves dropout was active at all."""
    import engine.model

    args = [*base, "train.max_steps=6", "model.dropout=0.1"]
    plain = [stable(r) for r in train_records(run(args))]

    calls = 0
    original = engine.model.checkpoint

    def counting(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*a, **kw)

    monkeypatch.setattr(engine.model, "checkpoint", counting)
    checkpointed = [
        stable(r) for r in train_records(run([*args, "model.activation_checkpointing=true"]))
    ]
    assert calls == 6 * 2, calls  # 6 steps x 2 blocks x 1 micro-batch
    assert checkpointed == plain
    no_dropout = losses(run([*base, "train.max_steps=6"]))
    assert max_diff(no_dropout, [r["train/loss"] for r in plain]) > 1e-3


# --------------------------------------------------------------------------- 6. compile


@pytest.mark.launches
@pytest.mark.slow
def test_compiled_model_trains_like_eager(base: list[str], run: Runner, tmp_path: Path) -> None:
    """train.compile=true (inductor, cold cache in a temp dir): the same losses as eager to
    1e-3 over 5 steps. A fresh process keeps dynamo's global state out of this one."""
    args = [*base, "train.max_steps=5", "model.n_layer=1"]  # one block: half the compiling
    eager = losses(run(args))
    cache = tmp_path / "inductor"
    proc = run_cli(
        [*args, "train.compile=true", f"hydra.run.dir={tmp_path / 'run'}"],
        timeout=COMPILE_TIMEOUT,
        TORCHINDUCTOR_CACHE_DIR=str(cache),
        TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    assert proc.returncode == 0, explain(proc)
    compiled = losses(read_metrics(tmp_path / "run"))
    diff = max_diff(eager, compiled)
    assert diff <= 1e-3, f"compiled vs eager: train/loss off by {diff:.2e}"
    assert any(cache.rglob("*.py")), "inductor wrote no code: was the model compiled?"


# --------------------------------------------------------------------------- 7. fake quant


def test_fake_quant_trains_and_differs_from_full_precision(run: Runner, base: list[str]) -> None:
    """4-bit STE training learns, and is not secretly full precision."""
    quant = losses(run([*base, "model.fake_quant_bits=4"]))
    full = losses(run(base))
    assert_learns(quant, "fake_quant_bits=4")
    diff = max_diff(quant, full)
    assert diff > 1e-3, f"4-bit losses within {diff:.1e} of full precision"


class LinearWeights(TorchFunctionMode):
    """Records the weight of every F.linear call made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[torch.Tensor] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            self.weights.append(weight.detach().clone())
        return func(*args, **kwargs)


def two_bit_reference(w: torch.Tensor) -> torch.Tensor:
    """2-bit symmetric grid {-s, 0, s}, s = max|w|: round(w / s) is +-1 beyond s / 2."""
    s = w.abs().max()
    return torch.where(w.abs() > s / 2, torch.sign(w) * s, torch.zeros_like(w))


def test_fake_quant_forward_uses_quantized_weights() -> None:
    """fake_quant_bits=2: every block linear multiplies by a weight with at most 3 distinct
    values (seen at the F.linear call itself), equal to the hand-rounded weight; the module's
    output is F.linear with that weight, not with the full-precision one."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, fake_quant_bits=2)
    torch.manual_seed(0)
    model = GPT.from_config(cfg).eval()
    idx = torch.randint(0, 64, (2, 16))
    mode = LinearWeights()
    with mode, torch.no_grad():
        model(idx)
    block_linears = [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]
    assert len(block_linears) == 4 * cfg.n_layer
    assert all(isinstance(m, FakeQuantLinear) for m in block_linears)
    quantized = [w for w in mode.weights if w.unique().numel() <= 3]
    assert len(quantized) == len(block_linears), [w.unique().numel() for w in mode.weights]
    references = [two_bit_reference(m.weight.detach()) for m in block_linears]
    for ref in references:
        assert any(w.shape == ref.shape and torch.equal(w, ref) for w in quantized)

    fc = model.blocks[0].mlp.fc
    x = torch.randn(5, cfg.n_embd)
    with torch.no_grad():
        out = fc(x)
        want = F.linear(x, two_bit_reference(fc.weight), fc.bias)
        full = F.linear(x, fc.weight, fc.bias)
    assert torch.allclose(out, want, atol=1e-6)
    assert (out - full).abs().max().item() > 1e-3
    # The gradient still reaches the full-precision weights (straight-through).
    model.train()
    loss = model(idx).square().mean()
    loss.backward()
    assert fc.weight.grad is not None and fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("bits", [1, 0])
def test_fake_quant_bits_below_two_is_a_config_error(bits: int) -> None:
    """Fewer than 2 bits leaves no quantization level: building the model (before any data is
    loaded) says so, naming the key."""
    cfg, _ = to_config(compose_config([f"model.fake_quant_bits={bits}"]))
    with pytest.raises(ConfigError, match=r"model\.fake_quant_bits"):
        build_model(cfg.model, DistInfo())
