"""The batch plan: how one optimizer step's global batch splits into data-parallel ranks x
accumulated micro-batches. Decided once from the config, then passed to the sampler, the
loader, `micro_batch_size=auto` and the progress record instead of each redoing the
arithmetic."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainer.config.errors import ConfigError

AUTO = "auto"


@dataclass(frozen=True)
class BatchPlan:
    """`global_batch = dp_size x accum x micro`: each of the `dp_size` data-parallel ranks
    sums `accum` micro-batches of `micro` samples into every optimizer step."""

    micro: int
    accum: int
    dp_size: int
    global_batch: int

    def __post_init__(self) -> None:
        if self.global_batch != self.micro * self.accum * self.dp_size:
            raise ValueError(
                f"global batch {self.global_batch} != dp {self.dp_size} x micro {self.micro} "
                f"x accum {self.accum}"
            )

    @classmethod
    def from_config(cls, train: Any, dp_size: int) -> BatchPlan:
        """The plan of the `train` config on `dp_size` data-parallel ranks.
        `train.global_batch_size`, when set, decides the accumulation count. Under
        `micro_batch_size=auto` the plan starts as the whole per-rank batch in one
        micro-batch; the probe narrows it with `with_micro` (trainer/run/auto_batch.py)."""
        if train.micro_batch_size == AUTO:
            check_auto(train, dp_size)
            return cls(train.global_batch_size // dp_size, 1, dp_size, train.global_batch_size)
        micro = train.micro_batch_size
        if train.global_batch_size is None:
            accum = train.grad_accum_steps
            return cls(micro, accum, dp_size, micro * accum * dp_size)
        per_step = micro * dp_size
        if train.global_batch_size % per_step:
            raise ConfigError(
                "train.global_batch_size",
                f"{train.global_batch_size} is not a multiple of train.micro_batch_size "
                f"({micro}) x world size ({dp_size}) = {per_step}; valid values "
                f"are {per_step}, {2 * per_step}, {3 * per_step}, ...",
            )
        return cls(micro, train.global_batch_size // per_step, dp_size, train.global_batch_size)

    @property
    def per_rank(self) -> int:
        """The samples one data-parallel rank sums into each optimizer step."""
        return self.micro * self.accum

    def with_micro(self, micro: int) -> BatchPlan:
        """The same global batch in micro-batches of `micro` samples (a divisor of
        `per_rank`): the accumulation takes up the difference."""
        if micro <= 0 or self.per_rank % micro:
            raise ValueError(
                f"micro-batch {micro} does not divide the per-rank batch {self.per_rank}"
            )
        return dataclasses.replace(self, micro=micro, accum=self.per_rank // micro)


def check_auto(train: Any, world_size: int) -> None:
    """Config errors of `micro_batch_size=auto` that need no model: before any work."""
    if train.micro_batch_size != AUTO:
        return
    if train.global_batch_size is None:
        raise ConfigError(
            "train.micro_batch_size",
            "auto finds the micro-batch that fits for a fixed global batch; set "
            "train.global_batch_size (e.g. 64), or give train.micro_batch_size a number",
        )
    if train.global_batch_size % world_size:
        raise ConfigError(
            "train.global_batch_size",
            f"{train.global_batch_size} does not split over the {world_size} ranks; valid "
            f"values are multiples of {world_size}",
        )
