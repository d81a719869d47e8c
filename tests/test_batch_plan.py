"""`BatchPlan`: the global batch split into ranks x accumulation x micro-batches, checked
against the arithmetic written out in each test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer.config.errors import ConfigError
from trainer.run.batch_plan import BatchPlan


def train(micro: object, accum: int = 2, global_batch: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        micro_batch_size=micro, grad_accum_steps=accum, global_batch_size=global_batch
    )


def test_accumulation_from_config_or_global_batch() -> None:
    assert BatchPlan.from_config(train(4, accum=3), 2) == BatchPlan(4, 3, 2, 24)
    plan = BatchPlan.from_config(train(4, global_batch=32), 2)
    assert plan == BatchPlan(4, 4, 2, 32)
    assert plan.per_rank == 16


def test_global_batch_not_a_multiple_names_the_valid_values() -> None:
    with pytest.raises(ConfigError, match=r"valid values are 8, 16, 24, \.\.\."):
        BatchPlan.from_config(train(4, global_batch=12), 2)


def test_auto_starts_from_the_per_rank_batch_and_shrinks_keeping_the_global_batch() -> None:
    plan = BatchPlan.from_config(train("auto", global_batch=24), 2)
    assert plan == BatchPlan(12, 1, 2, 24)
    assert plan.with_micro(3) == BatchPlan(3, 4, 2, 24)
    with pytest.raises(ValueError):
        plan.with_micro(5)
    with pytest.raises(ConfigError, match="multiples of 2"):
        BatchPlan.from_config(train("auto", global_batch=25), 2)


def test_frozen_and_consistent() -> None:
    with pytest.raises(ValueError):
        BatchPlan(4, 2, 2, 15)
    with pytest.raises(AttributeError):
        BatchPlan(4, 2, 2, 16).micro = 8  # type: ignore[misc]
