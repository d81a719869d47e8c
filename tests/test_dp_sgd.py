"""`step=dp_sgd`: per-sample clipping, noise once per step, exact under accumulation and ranks;
`train/epsilon` as Opacus's RDP accountant; `data.sampling=poisson`.

References are independent of the code under test: the noise-free update is recomputed in
float64 one sample at a time with `torch.autograd.grad`, each gradient clipped by
min(1, C/‖g‖) in plain Python; trainer runs are compared with other splits of the same global
batch; ε is compared with Opacus itself (when installed) and with values Opacus 1.6.0
printed once, written below. The model is float64 (tests/dp_support.py), so "the same" means
≤ 1e-10.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.callbacks import CallbackList
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.step import StepContext
from engine.steps.dp_sgd import DPSGDStep, PrivacySpent
from engine.steps.privacy import RDPAccountant, noise_for_epsilon
from engine.tasks import ClassificationTask
from tests.conftest import TINY, read_metrics, train_in_process
from tests.dp_support import blobs, mlp64
from tests.ranks import explain, run_cli, run_torchrun
from trainer.config.errors import ConfigError
from trainer.data.loader import GlobalBatchSampler, StepMicroBatches

EXACT = 1e-10
C, LR = 3.0, 0.5  # C inside the range of per-sample norms here (about 1.5 to 5)

# (q, sigma, steps, delta) -> epsilon, as printed by opacus 1.6.0's RDPAccountant
# (history [(sigma, q, steps)], get_epsilon(delta)), once, on 2026-11-23.
OPACUS_EPSILON = {
    (0.01, 1.1, 1000, 1e-5): 1.7117700912203435,
    (256 / 60000, 1.0, 2000, 1e-5): 1.2894882123598905,
    (0.1, 0.5, 50, 1e-5): 25.75091534122493,
    (0.004, 4.0, 10000, 1e-6): 0.43984140932683613,
    (0.5, 2.0, 10, 1e-3): 3.114605503923068,
}


# --------------------------------------------------------------------------- engine, by hand


def ctx_for(model: torch.nn.Module) -> StepContext:
    return StepContext(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        scheduler=None,
        task=ClassificationTask(),
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        clip_grad_norm=None,
        callbacks=CallbackList(),
    )


def reference_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """DP-SGD without noise from its definition: per-sample gradient, clip, sum, / batch, SGD.
    Returns the per-sample gradient norms (to show some were clipped and some not)."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        norms.append(norm)
        total = [t + min(1.0, C / norm) * g for t, g in zip(total, grads)]
    with torch.no_grad():
        for p, t in zip(params, total):
            p -= LR * t / x.shape[0]
    return norms


def windows(sizes: tuple[int, ...], steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    x, y = blobs()["train"].tensors
    n, out = sum(sizes), []
    for s in range(steps):
        start, window = s * n, []
        for size in sizes:
            window.append((x[start : start + size], y[start : start + size]))
            start += size
        out.append(window)
    return out


def test_noise_free_dp_sgd_equals_the_per_sample_definition() -> None:
    """3 steps, windows of unequal micro-batches (5, 11, 8, 8): ≤ 1e-10 from the reference,
    with both clipped and unclipped samples in play."""
    model, reference = mlp64(), mlp64()
    step = DPSGDStep(max_grad_norm=C, noise_multiplier=0.0)
    step.set_sampling(global_batch_size=32, dataset_size=256)
    ctx, norms = ctx_for(model), []
    for window in windows((5, 11, 8, 8), steps=3):
        step(ctx, window)
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        norms += reference_step(reference, x, y)
        err = max(
            (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
        )
        assert err <= EXACT, f"DP-SGD off the per-sample reference by {err:.2e}"
    assert min(norms) < C < max(norms), f"clip bound {C} not inside the norms' range"


def noisy_update(sizes: tuple[int, ...], sigma: float) -> list[torch.Tensor]:
    model = mlp64()
    before = [p.detach().clone() for p in model.parameters()]
    step = DPSGDStep(max_grad_norm=C, noise_multiplier=sigma, seed=7)
    step.set_sampling(global_batch_size=32, dataset_size=256)
    step(ctx_for(model), windows(sizes, steps=1)[0])
    return [(b - p.detach()).flatten() / LR for b, p in zip(before, model.parameters())]


def test_noise_is_added_once_per_step_whatever_the_split() -> None:
    """The noisy mean gradient minus the noise-free one, × batch, has std σC (noise added once,
    not per micro-batch: that would give σC·√4), and is the same for any split."""
    sigma = 2.0
    clean = torch.cat(noisy_update((8, 8, 8, 8), 0.0))
    split4 = torch.cat(noisy_update((8, 8, 8, 8), sigma))
    whole = torch.cat(noisy_update((32,), sigma))
    assert (split4 - whole).abs().max().item() <= EXACT
    noise = (split4 - clean) * 32
    std = noise.std().item()
    assert std == pytest.approx(sigma * C, rel=0.15), f"noise std {std:.3f} vs σC {sigma * C}"


# --------------------------------------------------------------------------- accountant


@pytest.mark.parametrize("args", list(OPACUS_EPSILON), ids=lambda a: f"q{a[0]:.3g}-s{a[1]}")
def test_epsilon_matches_opacus_reference_values(args: tuple[float, float, int, float]) -> None:
    q, sigma, steps, delta = args
    got = RDPAccountant(q, sigma).epsilon(steps, delta)
    assert got == pytest.approx(OPACUS_EPSILON[args], rel=1e-9)


def opacus_epsilon(q: float, sigma: float, steps: int, delta: float) -> float | None:
    """Opacus's RDPAccountant's ε, or None where Opacus is not installed."""
    try:
        from opacus.accountants import RDPAccountant as OpacusRDP
    except ImportError:
        return None
    acc = OpacusRDP()
    acc.history = [(sigma, q, steps)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha"
        return float(acc.get_epsilon(delta=delta))


def test_epsilon_matches_installed_opacus() -> None:
    """Against Opacus itself (skipped where it is not installed: `pip install opacus`)."""
    pytest.importorskip("opacus.accountants")
    for q, sigma, steps, delta in [(0.02, 0.9, 300, 1e-5), (0.125, 1.3, 40, 1e-6)]:
        want = opacus_epsilon(q, sigma, steps, delta)
        assert RDPAccountant(q, sigma).epsilon(steps, delta) == pytest.approx(want, rel=1e-9)


# --------------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def dp_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The float64 model and blobs as a user's config folder; plain SGD, no global clipping."""
    root = tmp_path_factory.mktemp("dp_configs")
    (root / "model").mkdir()
    (root / "data").mkdir()
    (root / "model" / "mlp64.yaml").write_text("_target_: tests.dp_support.mlp64\n")
    (root / "data" / "blobs.yaml").write_text("_target_: tests.dp_support.blobs\n")
    return [
        f"hydra.searchpath=[file://{root}]",
        "model=mlp64",
        "data=blobs",
        "task=classification",
        "optim=sgd",
        "optim.lr=0.5",
        "optim.momentum=0.0",
        "scheduler=constant",
        "train.clip_grad_norm=null",
        "logger=none",
        "train.log_every=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "train.max_steps=6",
        "step=dp_sgd",
        "step.max_grad_norm=0.3",
        "step.noise_multiplier=1.5",
        "step.delta=1e-5",
    ]


def train_values(run_dir: Path) -> list[tuple[float, float, float]]:
    return [
        (r["train/loss"], r["train/grad_norm"], r["train/epsilon"])
        for r in read_metrics(run_dir)
        if "train/loss" in r
    ]


@pytest.mark.multiproc
def test_trajectory_is_the_same_for_one_process_and_two_ranks(
    dp_args: list[str], tmp_path: Path
) -> None:
    """1 process x micro 8 x accum 4 and 2 ranks x micro 8 x accum 2: the same losses and
    (noisy) gradient norms to 1e-10 in float64, so the noise is drawn and added once, and
    DDP's averaging plays no part; ε is Opacus's at q = 32 / 256."""
    args = [*dp_args, "train.micro_batch_size=8"]
    train_in_process([*args, "train.grad_accum_steps=4"], tmp_path / "one")
    proc = run_torchrun(
        2, [*args, "train.grad_accum_steps=2", f"hydra.run.dir={tmp_path / 'two'}"], timeout=150
    )
    assert proc.returncode == 0, explain(proc)
    one, two = train_values(tmp_path / "one"), train_values(tmp_path / "two")
    assert len(one) == len(two) == 6
    for (loss_a, norm_a, eps_a), (loss_b, norm_b, eps_b) in zip(one, two):
        assert abs(loss_a - loss_b) <= EXACT and abs(norm_a - norm_b) <= EXACT, (one, two)
        assert eps_a == eps_b
    for step, (_, _, eps) in enumerate(one, start=1):
        want = OPACUS_REF_TRAINER[step - 1]
        assert eps == pytest.approx(want, rel=1e-9)
        opacus = opacus_epsilon(32 / 256, 1.5, step, 1e-5)
        assert opacus is None or eps == pytest.approx(opacus, rel=0.01)
    # The noise matters: without it the gradient norms differ.
    train_in_process([*args, "train.grad_accum_steps=4", "step.noise_multiplier=0"], tmp_path / "z")
    clean = train_values(tmp_path / "z")
    assert abs(clean[0][1] - one[0][1]) > 1e-3


# opacus 1.6.0, RDPAccountant at q = 32/256, sigma 1.5, delta 1e-5, after steps 1..6.
OPACUS_REF_TRAINER = [
    1.0792257793730433,
    1.2315043455395995,
    1.3470385102756748,
    1.4456820480025958,
    1.5339637914327202,
    1.6149103897951724,
]


def test_poisson_batches_are_a_pure_function_of_seed_and_step(
    dp_args: list[str], tmp_path: Path
) -> None:
    """Each step's Poisson batch depends on (seed, step) only, has about q·N samples, and the
    rank x accumulation split covers it exactly once; training with it is the same for
    micro 8 x accum 4 and micro 32 x accum 1 (the divisor is the expected batch, 32)."""
    a = GlobalBatchSampler(256, 32, seed=5, sampling="poisson")
    b = GlobalBatchSampler(256, 32, seed=5, sampling="poisson")
    sizes = []
    for step in (0, 1, 7, 100):
        got = a.global_indices(step)
        assert np.array_equal(got, b.global_indices(step))
        sizes.append(len(got))
        mine = []
        for rank in (0, 1):
            it = iter(StepMicroBatches(a, rank, micro=8, accum=2, start_step=step))
            mine += [key[0] for _ in range(2) for key in next(it)]
        assert sorted(mine) == sorted(got.tolist())
    assert len(set(sizes)) > 1 and all(10 < s < 60 for s in sizes), sizes
    assert not np.array_equal(a.global_indices(0), a.global_indices(1))

    args = [*dp_args, "data.sampling=poisson"]
    train_in_process(
        [*args, "train.micro_batch_size=8", "train.grad_accum_steps=4"], tmp_path / "a"
    )
    train_in_process(
        [*args, "train.micro_batch_size=32", "train.grad_accum_steps=1"], tmp_path / "b"
    )
    for x, y in zip(train_values(tmp_path / "a"), train_values(tmp_path / "b")):
        assert max(abs(u - v) for u, v in zip(x, y)) <= EXACT


@pytest.mark.launches
def test_batch_norm_is_refused_with_one_paragraph(dp_args: list[str], tmp_path: Path) -> None:
    proc = run_cli([*dp_args, "+model.batch_norm=true", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 2, explain(proc)
    assert "BatchNorm1d" in proc.stderr and "GroupNorm" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)


# --------------------------------------------------------------------------- target epsilon

# (target epsilon, delta, q, steps) -> the noise multiplier opacus 1.6.0's get_noise_multiplier
# (what make_private_with_epsilon uses) returned, once, on 2026-11-26.
OPACUS_SIGMA = {
    (2.0, 1e-5, 32 / 256, 6): 1.337890625,
    (1.0, 1e-5, 0.01, 1000): 1.5234375,
    (8.0, 1e-6, 256 / 60000, 2000): 0.5670166015625,
    (0.5, 1e-5, 0.004, 10000): 3.203125,
    (10.0, 1e-3, 0.5, 10): 0.904541015625,
}


def opacus_sigma(target: float, delta: float, q: float, steps: int) -> float | None:
    """Opacus's own choice, or None where Opacus is not installed."""
    try:
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_noise_multiplier(
            target_epsilon=target, target_delta=delta, sample_rate=q, steps=steps
        )


@pytest.mark.parametrize("args", list(OPACUS_SIGMA), ids=lambda a: f"eps{a[0]:g}-q{a[2]:.3g}")
def test_target_epsilon_chooses_opacus_noise_multiplier(
    args: tuple[float, float, float, int],
) -> None:
    """The same σ as Opacus (its printed values; Opacus itself where installed): a σ whose ε
    is at most the target and within Opacus's tolerance (0.01) of it."""
    target, delta, q, steps = args
    sigma = noise_for_epsilon(*args)
    assert sigma == OPACUS_SIGMA[args]
    live = opacus_sigma(*args)
    assert live is None or sigma == live
    spent = RDPAccountant(q, sigma).epsilon(steps, delta)
    assert target - 0.01 <= spent <= target


def test_unreachable_target_and_both_settings_are_one_line() -> None:
    """Below the RDP bound's floor no noise reaches the target (as Opacus: "The privacy
    budget is too low"): one line naming target_epsilon, what was reached and what to
    change. The end-of-run summary line states ε, δ, σ, q and the target."""
    step = DPSGDStep(1.0, target_epsilon=0.05, steps=100)
    with pytest.raises(ValueError, match=r"^target_epsilon 0\.05 is out of reach: after 100 steps"):
        step.set_sampling(32, 256)
    with pytest.raises(
        ValueError, match=r"^noise_multiplier and target_epsilon are both set \(1\.5 and 2\)"
    ):
        DPSGDStep(1.0, noise_multiplier=1.5, target_epsilon=2.0, steps=6)
    step = DPSGDStep(1.0, target_epsilon=2.0, steps=6)
    step.set_sampling(32, 256)
    assert step.noise_multiplier == OPACUS_SIGMA[(2.0, 1e-5, 32 / 256, 6)]
    spent = PrivacySpent(step)
    spent.steps = 6
    assert spent.summary(global_batch_size=32) == (
        "  privacy: epsilon 1.9997 at delta 1e-05 after 6 steps (noise multiplier 1.33789, "
        "sampling rate 0.125); target epsilon 2 over 6 steps"
    )


# With momentum: the extension resumes an optimizer with per-parameter state.
TARGET = ["train.micro_batch_size=8", "train.grad_accum_steps=4", "optim.momentum=0.5"]
TARGET.append("step.noise_multiplier=null")


@pytest.mark.launches
def test_target_epsilon_run_uses_opacus_noise_and_shows_epsilon(
    dp_args: list[str], tmp_path: Path
) -> None:
    """`step.target_epsilon=2` over 6 steps at q = 32/256: the run adds Opacus's σ (the same
    trajectory as `step.noise_multiplier=` that σ), spends at most 2 (ε within 0.01 of it),
    prints ε in the progress line, and a run extended to 9 steps keeps the σ its checkpoint
    chose (so ε past the target is the truth)."""
    sigma = OPACUS_SIGMA[(2.0, 1e-5, 32 / 256, 6)]
    args = [*dp_args, *TARGET, "step.target_epsilon=2.0", "checkpoint.every_steps=3"]
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'target'}"])
    assert proc.returncode == 0, explain(proc)
    train_in_process([*dp_args, *TARGET, f"step.noise_multiplier={sigma!r}"], tmp_path / "sigma")
    got, same = train_values(tmp_path / "target"), train_values(tmp_path / "sigma")
    assert len(got) == 6
    for (loss_a, norm_a, eps_a), (loss_b, norm_b, eps_b) in zip(got, same):
        assert abs(loss_a - loss_b) <= EXACT and abs(norm_a - norm_b) <= EXACT, (got, same)
        assert eps_a == eps_b
    assert 1.99 <= got[-1][2] <= 2.0
    assert got[-1][2] == pytest.approx(RDPAccountant(32 / 256, sigma).epsilon(6, 1e-5), rel=1e-12)
    assert f"eps {got[-1][2]:.3g} | eta" in proc.stdout, explain(proc)

    train_in_process([*args, "train.max_steps=9"], tmp_path / "target")
    longer = train_values(tmp_path / "target")
    assert len(longer) == 9 and longer[:6] == got
    for step, (_, _, eps) in enumerate(longer[6:], start=7):
        assert eps == pytest.approx(RDPAccountant(32 / 256, sigma).epsilon(step, 1e-5), rel=1e-12)
    assert longer[-1][2] > 2.0


@pytest.mark.launches
def test_target_epsilon_refusals_through_the_trainer(dp_args: list[str], tmp_path: Path) -> None:
    """Both settings: exit 2, one paragraph naming step.noise_multiplier, no traceback."""
    proc = run_cli([*dp_args, "step.target_epsilon=2", f"hydra.run.dir={tmp_path / 'both'}"])
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert "invalid config `step.noise_multiplier`" in line and "both set" in line, line


@pytest.mark.launches
def test_unreachable_target_through_the_trainer(dp_args: list[str], tmp_path: Path) -> None:
    """An unreachable target: exit 2, one paragraph naming step.target_epsilon."""
    args = [*dp_args, *TARGET, "step.target_epsilon=0.05", f"hydra.run.dir={tmp_path}"]
    proc = run_cli(args)
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert "invalid config `step.target_epsilon`" in line and "out of reach" in line, line


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_precisions_other_than_fp32_and_bf16_are_refused(precision: str, tmp_path: Path) -> None:
    """step=dp_sgd under fp16 (a loss scaler) or fp8 (torchao's float8 layers, which vmap
    cannot transform: fp8 failed with a traceback at the first step): one paragraph naming
    train.precision before anything trains."""
    extra = ["train.fp8_emulate=true"] if precision == "fp8" else []
    if precision == "fp8" and importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao (the extra fp8) not installed")
    args = [*TINY, "step=dp_sgd", "step.max_grad_norm=1.0", "step.noise_multiplier=1.0"]
    args += [f"train.precision={precision}", *extra, f"hydra.run.dir={tmp_path}"]
    with pytest.raises(ConfigError) as err:
        train_in_process(args, tmp_path)
    message = str(err.value)
    assert message.startswith("invalid config `train.precision`: step=dp_sgd supports fp32 or")
    assert f"bf16, not {precision}" in message and "\n" not in message, message
    assert not (tmp_path / "metrics.jsonl").exists()
