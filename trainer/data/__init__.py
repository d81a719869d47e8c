"""Data as a component: `data._target_` names a callable that returns the datasets.

The callable returns `DataSplits` or a dict with the same keys (`train`, `val`, optionally
`collate_fn`, ...). Any map-style dataset works (`__len__` and `__getitem__`): the samples of
optimizer step `s` are then a pure function of (seed, s, global batch size), whatever the
number of ranks, micro-batches or loader workers (`trainer.data.loader`). Samples of
different lengths need a `collate_fn`: `pad_collate(pad={...})` pads each field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from trainer.config.errors import ConfigError
from trainer.data.collate import PadCollate, pad_collate

__all__ = ["FIELDS", "DataSplits", "PadCollate", "as_splits", "pad_collate"]


@dataclass
class DataSplits:
    """What a `data._target_` returns.

    Args:
        train, val: map-style datasets.
        collate_fn: list of samples -> batch (default: `torch.utils.data.default_collate`).
        vocab_size: for token data, the smallest vocabulary covering its ids (checked
            against the model's `vocab_size`).
        seq_len: tokens per sample at most (checked against the model's `max_seq_len`; MFU).
        decode: token ids -> text, for the text samples written at evaluation.
        description: one line for the console.
    """

    train: Any
    val: Any
    collate_fn: Callable[[list[Any]], Any] | None = None
    vocab_size: int | None = None
    seq_len: int | None = None
    decode: Callable[[list[int]], str] | None = None
    description: str = ""


FIELDS = [f.name for f in dataclasses.fields(DataSplits)]


@runtime_checkable
class MapStyle(Protocol):
    """A map-style dataset: its length, and a sample by index."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Any: ...


def _is_map_style(ds: Any) -> bool:
    from torch.utils.data import IterableDataset

    return not isinstance(ds, IterableDataset) and isinstance(ds, MapStyle)


def as_splits(obj: Any, target: str) -> DataSplits:
    """`obj` (what `data._target_` returned) as checked `DataSplits`."""
    if isinstance(obj, DataSplits):
        splits = obj
    elif isinstance(obj, Mapping) or dataclasses.is_dataclass(obj):
        fields = dict(obj) if isinstance(obj, Mapping) else vars(obj)
        unknown = sorted(set(fields) - set(FIELDS))
        missing = [k for k in ("train", "val") if k not in fields]
        if unknown or missing:
            raise ConfigError(
                "data._target_",
                f"{target} returned {'keys ' + str(unknown) if unknown else ''}"
                f"{' and ' if unknown and missing else ''}"
                f"{'no ' + ' or '.join(missing) if missing else ''}; valid keys: "
                f"{', '.join(FIELDS)} (train and val are required)",
            )
        splits = DataSplits(**fields)
    else:
        raise ConfigError(
            "data._target_",
            f"{target} returned a {type(obj).__name__}; it must return "
            '{"train": Dataset, "val": Dataset, "collate_fn": optional} (or DataSplits)',
        )
    for name, ds in (("train", splits.train), ("val", splits.val)):
        if not _is_map_style(ds):
            raise ConfigError(
                "data._target_",
                f"{target} returned a {name} dataset of type {type(ds).__name__}, which is not "
                "map-style: cumulus needs __len__ and __getitem__ (not an IterableDataset), so "
                "that the samples of each step are a pure function of (seed, step, global "
                "batch size) and resume is exact. Wrap the data in a map-style Dataset.",
            )
    if len(splits.train) == 0:
        raise ConfigError("data", f"{target} returned an empty training set")
    return splits
