"""Split invariance through the real trainer: the same global batch of 16, cut as micro 16 x
accum 1, 4 x 4 or 2 x 8, must train the same model, so every logged `train/loss` agrees.

Each run is the Hydra-composed trainer in this process (`tests.conftest.train_in_process`) for
10 optimizer steps of `model=gpt_tiny`, logging every step. Two negative controls keep the
equality from being vacuous: another seed, and a step strategy with the textbook
mean-per-micro-batch bug, both give different records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from engine.step import Batch, StepContext, StepResult
from engine.steps.accumulate import count_window, finish_step
from tests.conftest import TINY, train_in_process, train_records

STEPS = 10
GLOBAL_BATCH = 16
SPLITS = ((16, 1), (4, 4), (2, 8))  # (micro_batch_size, grad_accum_steps)
LOSS_ATOL = 1e-5

Records = list[dict[str, Any]]
Runner = Callable[[Sequence[str]], Records]


def overrides(packed: bool, micro: int, accum: int, *extra: str) -> list[str]:
    """TINY plus one split of the global batch; `extra` comes last and wins."""
    return [
        *TINY,
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        f"train.micro_batch_size={micro}",
        f"train.grad_accum_steps={accum}",
        f"data.packed={str(packed).lower()}",
        *extra,
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    """Runs the trainer once per distinct override list; tests share the records."""
    cache: dict[tuple[str, ...], Records] = {}

    def _run(args: Sequence[str]) -> Records:
        key = tuple(args)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("run")
            cache[key] = train_records(train_in_process(list(args), run_dir))
            assert [r["step"] for r in cache[key]] == list(range(1, STEPS + 1)), key
        return cache[key]

    return _run


def losses(records: Records) -> list[float]:
    return [r["train/loss"] for r in records]


def max_loss_diff(a: Records, b: Records) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) for x, y in zip(losses(a), losses(b)))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_loss_records_do_not_depend_on_the_split(run: Runner, packed: bool) -> None:
    """16 x 1, 4 x 4 and 2 x 8 log the same loss at every step (unpacked: micro-batches hold
    different token counts, so this needs the division by the window's global count)."""
    base = run(overrides(packed, *SPLITS[0]))
    for micro, accum in SPLITS[1:]:
        other = run(overrides(packed, micro, accum))
        diff = max_loss_diff(base, other)
        assert diff <= LOSS_ATOL, f"micro {micro} x accum {accum}: train/loss off by {diff:.2e}"
        for x, y in zip(base, other):
            assert x["train/lr"] == y["train/lr"]
            assert x["train/grad_norm"] == pytest.approx(y["train/grad_norm"], rel=1e-5)


def test_global_batch_size_derives_accum(run: Runner, capsys: pytest.CaptureFixture[str]) -> None:
    """global_batch_size=16 with micro 4 derives accum 4 (TINY's grad_accum_steps=2 is
    ignored) and trains exactly like an explicit micro 4 x accum 4."""
    derived = run(overrides(True, 4, 2, f"train.global_batch_size={GLOBAL_BATCH}"))
    out = capsys.readouterr().out
    assert f"micro 4 x accum 4 = global batch {GLOBAL_BATCH}" in out, out
    explicit = run(overrides(True, 4, 4))
    for x, y in zip(derived, explicit, strict=True):
        assert x["train/loss"] == y["train/loss"] and x["train/grad_norm"] == y["train/grad_norm"]


def test_another_seed_gives_other_records(run: Runner) -> None:
    """Negative control: the split comparison can fail, since a different seed (weights and
    data order) moves the loss far beyond the tolerance."""
    base = run(overrides(True, *SPLITS[0]))
    other = run(overrides(True, *SPLITS[0], "seed=7"))
    diff = max_loss_diff(base, other)
    assert diff > 100 * LOSS_ATOL, f"seed changed train/loss by only {diff:.2e}"


class TextbookMeanStep:
    """The textbook bug as a step strategy: each micro-batch's mean loss divided by accum.

    Used as `step._target_` to show the split test detects it on unpacked data.
    """

    def __call__(self, ctx: StepContext, window: Sequence[Batch]) -> StepResult:
        ctx.optimizer.zero_grad(set_to_none=True)
        global_count = count_window(ctx, window)
        loss_sum = torch.zeros((), dtype=torch.float32, device=ctx.dist.device)
        for batch in window:
            micro_sum = ctx.task.loss_sum(ctx.model, batch)
            (micro_sum / ctx.task.count_items(batch) / len(window)).backward()
            loss_sum += micro_sum.detach()
        return finish_step(ctx, loss_sum, global_count)


def test_textbook_accumulation_breaks_split_invariance(run: Runner) -> None:
    """Negative control: mean-per-micro-batch accumulation, unpacked, 4 x 4, drifts away from
    16 x 1 by more than the tolerance (with accum 1 it is the correct step, so that run is the
    shared baseline)."""
    base = run(overrides(False, *SPLITS[0]))
    target = f"step._target_={__name__}.TextbookMeanStep"
    buggy = run(overrides(False, 4, 4, target))
    diff = max_loss_diff(base, buggy)
    assert diff > 10 * LOSS_ATOL, f"textbook accumulation only {diff:.2e} off"
