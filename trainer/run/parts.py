"""What the assembly has built so far (`Parts`, handed from one extension point to the next),
and what it returns to every command (`Assembly`)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.distributed import DistInfo
from engine.numerics.float8 import Float8Layers
from engine.parallel.base import Parallelism
from engine.parallel.dims import ParallelDims
from trainer.config.schema import Config, DataExtras, ModelExtras
from trainer.data import DataSplits
from trainer.models.lora import Adapter
from trainer.run.compatibility import Choices


@dataclass(frozen=True)
class Parts:
    """The run's parts as the assembly builds them, in order: a point that builds or replaces
    one returns new parts (`replace`), so what each point added is its return value. None:
    not built yet at this point."""

    cfg: Config
    info: DistInfo
    dims: ParallelDims
    parallel: Parallelism
    data: DataSplits
    data_extras: DataExtras
    # Where models are built and laid out: the planner's fake tensors, or nothing.
    building: contextlib.AbstractContextManager = dataclasses.field(
        default_factory=contextlib.nullcontext
    )
    simulated: bool = False  # trainer.plan: a simulated world of fake tensors (no pass runs)
    training: bool = False  # python -m trainer.train (not evaluation, export or the planner)
    model: nn.Module | None = None
    model_extras: ModelExtras | None = None
    adapter: Adapter | None = None  # adapter=lora: peft's adapters on the frozen base
    task: Any = None
    float8: Float8Layers | None = None  # train.precision=fp8: the layers converted and kept
    # The dtype the laid-out model computes its parameters in (assemble's `parameter_dtype`).
    param_dtype: torch.dtype | None = None
    wrapped: nn.Module | None = None  # what the step calls, once laid out

    def replace(self, **changes: Any) -> Parts:
        return dataclasses.replace(self, **changes)

    def built_model(self) -> nn.Module:
        """The model (from `model_built` on)."""
        assert self.model is not None, "the model is not built yet at this point"
        return self.model


@dataclass(frozen=True)
class Assembly:
    """A model laid out over the job's ranks, with its task and data: what every command
    starts from. `built` is what the assembly built (`model` the user's module, pruned to
    this rank's stages under a pipeline; `wrapped` what the step calls); `extensions` the
    features that took part, which take part in the training run's build too
    (trainer/run/build.py)."""

    built: Parts
    flops_per_token: float  # of the whole model, before any pipeline stage pruned it
    n_params: int
    n_trainable: int  # parameters that train (all of them without an adapter)
    extensions: Any  # trainer/run/extensions' `Extensions` of this run
    choices: Choices  # what the compatibility table was asked last (the task built)

    @property
    def model(self) -> nn.Module:
        return self.built.built_model()

    @property
    def wrapped(self) -> nn.Module:
        assert self.built.wrapped is not None
        return self.built.wrapped

    @property
    def model_extras(self) -> ModelExtras:
        assert self.built.model_extras is not None
        return self.built.model_extras

    @property
    def parallel(self) -> Parallelism:
        return self.built.parallel

    @property
    def task(self) -> Any:
        return self.built.task

    @property
    def data(self) -> DataSplits:
        return self.built.data

    @property
    def data_extras(self) -> DataExtras:
        return self.built.data_extras

    @property
    def adapter(self) -> Adapter | None:
        return self.built.adapter

    @property
    def float8(self) -> Float8Layers | None:
        return self.built.float8

    def precision(self, mode: str) -> str:
        """`train.precision` in the banner's words (fp8: which layers are float8)."""
        return self.float8.describe() if self.float8 is not None else mode
