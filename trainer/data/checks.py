"""The data contract, checked where users break it: samples that cannot be batched become one
paragraph naming `data._target_` and the fix; a failure inside the user's own code keeps its
traceback, headed by one line naming the component and the step."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from engine.rng import rng_state, set_rng_state
from trainer.config.contract import annotate
from trainer.config.errors import ConfigError, UserError
from trainer.data import DataSplits

PAD_HINT = (
    'return "collate_fn": pad_collate(pad={"FIELD": PAD_VALUE, ...}) (from trainer.data: '
    "each field padded to the longest in the micro-batch with its own pad value, Python lists "
    "and numbers turned into tensors) next to the splits"
)


def _fields(sample: Any) -> list[tuple[str, Any]]:
    if isinstance(sample, Mapping):
        return [(f"field `{k}`", v) for k, v in sample.items()]
    if isinstance(sample, tuple | list) and sample and not _numbers(sample):
        return [(f"element {i}", v) for i, v in enumerate(sample)]
    return [("the sample", sample)]


def _numbers(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, int | float | list) for v in x)


def check_samples(data: DataSplits, target: str) -> None:
    """Samples holding Python lists, without a `collate_fn`: `default_collate` would turn a
    list into a list of per-position tensors (transposed), which no model expects."""
    if data.collate_fn is not None or len(data.train) == 0:
        return
    state = rng_state()  # a sample may draw augmentations: the run's randomness is untouched
    try:
        sample = data.train[0]
    except Exception as exc:  # the user's __getitem__: its traceback, headed
        raise annotate(exc, f"error in data `{target}` reading training sample 0") from None
    finally:
        set_rng_state(state)
    for name, value in _fields(sample):
        if isinstance(value, list):
            raise ConfigError(
                "data",
                f"{target} returns samples whose {name} is a Python list "
                f"({repr(value)[:60]}); without a collate_fn, default_collate would batch it "
                "as a list of per-position tensors, not one (batch, ...) tensor. Return tensors "
                f"from __getitem__ (torch.tensor(...)), or {PAD_HINT}",
            )


def next_window(windows: Iterator[Any], batches: Any, target: str, step: int) -> Any:
    """The next window of `windows`; a failure in the user's dataset or collate_fn is raised
    as `data_failure` words it."""
    try:
        return next(windows)
    except Exception as exc:
        failure = data_failure(exc, target, batches.collate_fn, step)
        if failure is exc:
            raise
        raise failure from None


def data_failure(exc: BaseException, target: str, collate_fn: Any, step: int) -> BaseException:
    """What to raise when loading the batches of `step` failed."""
    text = str(exc)
    unequal = (
        "stack expects each tensor to be equal size" in text
        or "each element in list of batch should be of equal size" in text
    )
    if collate_fn is None and unequal:
        detail = next(
            (ln.strip() for ln in reversed(text.splitlines()) if "equal size" in ln), text
        )
        return UserError(
            f"invalid config `data`: the samples of {target} have different shapes and no "
            f"collate_fn batches them (default_collate: {detail[:160]}). For variable-length "
            f"samples {PAD_HINT}."
        )
    where = "data.collate_fn" if collate_fn is not None else f"data `{target}`"
    return annotate(exc, f"error in {where} while loading the batches of step {step}")
