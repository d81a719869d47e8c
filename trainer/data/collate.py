"""Padding variable-length samples into one micro-batch: `pad_collate`.

`torch.utils.data.default_collate` stacks, so samples of different lengths fail with "stack
expects each tensor to be equal size". `pad_collate(pad={...})` returns the `collate_fn` that
pads each field to the longest in the micro-batch with its own pad value (inputs with 0,
labels with -100 so padding is no loss item) and stacks the fields of fixed size.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

Key = str | int
Number = int | float | bool


class PadCollate:
    """The collate function `pad_collate` returns (a class, so loader workers can pickle it).

    See `pad_collate` for the arguments.
    """

    def __init__(
        self,
        pad: Mapping[Key, Number] | Sequence[Number] | Number | None = None,
        *,
        lengths: bool | str = False,
        mask: bool | str = False,
        length_of: Key | None = None,
        pad_to_multiple_of: int = 1,
    ) -> None:
        if isinstance(pad, Sequence) and not isinstance(pad, str):
            pad = dict(enumerate(pad))
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.pad = pad
        self.lengths = "lengths" if lengths is True else lengths or None
        self.mask = "attention_mask" if mask is True else mask or None
        self.length_of = length_of
        self.multiple = pad_to_multiple_of
        self._single = False

    def __repr__(self) -> str:
        extras = [f"{k}={v!r}" for k, v in (("lengths", self.lengths), ("mask", self.mask)) if v]
        return f"pad_collate({', '.join([f'pad={self.pad!r}', *extras])})"

    def __call__(self, samples: list[Any]) -> Any:
        if not samples:
            raise ValueError("pad_collate: an empty list of samples")
        first = samples[0]
        if isinstance(first, Mapping):
            keys: list[Key] = list(first)
            for s in samples:
                if not isinstance(s, Mapping) or s.keys() != first.keys():
                    got = sorted(s) if isinstance(s, Mapping) else type(s).__name__
                    raise ValueError(
                        f"pad_collate: every sample must have the same fields; the first has "
                        f"{keys}, another {got}"
                    )
        elif _is_fields(first):
            keys = list(range(len(first)))
            if any(not _is_fields(s) or len(s) != len(keys) for s in samples):
                raise ValueError(
                    f"pad_collate: every sample must have the same {len(keys)} fields as the "
                    "first one"
                )
        else:  # one field per sample: a tensor, an array, a list of numbers
            keys = [0]
            samples = [(s,) for s in samples]
        self._single = not isinstance(first, Mapping) and not _is_fields(first)
        self._check_pad_keys(keys)
        fields = {k: self._field(k, [s[k] for s in samples]) for k in keys}
        out: dict[Key, Any] = {k: v for k, (v, _) in fields.items()}
        if self.lengths or self.mask:
            lengths = self._lengths(fields)  # (B,)
            if self.lengths:
                out[self.lengths] = lengths
            if self.mask:
                width = int(lengths.max()) if len(lengths) else 0
                width = _round_up(width, self.multiple)
                # (B, L): 1 at real positions, 0 at padding (Hugging Face's attention_mask).
                out[self.mask] = (torch.arange(width) < lengths[:, None]).long()
        if isinstance(first, Mapping):
            return out
        values = list(out.values())
        if not _is_fields(first):
            return values[0] if len(values) == 1 else tuple(values)
        return values if isinstance(first, list) else tuple(values)

    def _check_pad_keys(self, keys: list[Key]) -> None:
        if isinstance(self.pad, Mapping):
            unknown = [k for k in self.pad if k not in keys]
            if unknown:
                raise ValueError(
                    f"pad_collate: pad names {unknown}, which the samples do not have; their "
                    f"fields are {keys}"
                )

    def _pad_value(self, key: Key) -> Number | None:
        if isinstance(self.pad, Mapping):
            return self.pad.get(key)
        return self.pad

    def _field(self, key: Key, values: list[Any]) -> tuple[Any, list[int] | None]:
        """The collated field and, when its values are tensors, their sizes along dim 0."""
        tensors = [_as_tensor(v) for v in values]
        if any(t is None for t in tensors):
            return values, None  # strings, ids, nested objects: kept as a list
        shapes = {tuple(t.shape) for t in tensors}
        sizes = [t.shape[0] if t.dim() else 1 for t in tensors]
        # Empty values (a sequence of length 0) do not decide the dtype of the field.
        nonempty = [t for t in tensors if t.numel()] or tensors
        dtype = nonempty[0].dtype
        for t in nonempty[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        pad = self._pad_value(key)
        if len(shapes) == 1 and (pad is None or self.multiple == 1 or not tensors[0].dim()):
            return torch.stack([t.to(dtype) for t in tensors]), sizes
        if pad is None:
            example = "pad=0" if self._single else f"pad={{{key!r}: 0}}"
            raise ValueError(
                f"pad_collate: field {key!r} has samples of different shapes "
                f"{sorted(shapes)[:4]}; give it a pad value, e.g. pad_collate({example})"
            )
        if len({t.dim() for t in tensors}) != 1 or not tensors[0].dim():
            raise ValueError(
                f"pad_collate: field {key!r} mixes tensors of different numbers of dimensions "
                f"{sorted(shapes)[:4]}; only sizes may differ"
            )
        longest = [max(s[d] for s in shapes) for d in range(tensors[0].dim())]
        longest[0] = _round_up(longest[0], self.multiple)
        out = torch.full((len(tensors), *longest), pad, dtype=dtype)  # (B, L, ...)
        for row, t in zip(out, tensors):
            row[tuple(slice(0, n) for n in t.shape)] = t
        return out, sizes

    def _lengths(self, fields: dict[Key, tuple[Any, list[int] | None]]) -> torch.Tensor:
        if self.length_of is not None:
            if self.length_of not in fields:
                raise ValueError(
                    f"pad_collate: length_of={self.length_of!r} is not a field; the fields are "
                    f"{list(fields)}"
                )
            key = self.length_of
        else:  # the first padded field, else the first tensor field
            padded = [k for k in fields if self._pad_value(k) is not None and fields[k][1]]
            tensors = [k for k in fields if fields[k][1]]
            if not tensors:
                raise ValueError("pad_collate: lengths/mask asked for, but no field is a tensor")
            key = (padded or tensors)[0]
        sizes = fields[key][1]
        if sizes is None:
            raise ValueError(f"pad_collate: length_of={key!r} is not a tensor field")
        return torch.tensor(sizes, dtype=torch.int64)


def pad_collate(
    pad: Mapping[Key, Number] | Sequence[Number] | Number | None = None,
    *,
    lengths: bool | str = False,
    mask: bool | str = False,
    length_of: Key | None = None,
    pad_to_multiple_of: int = 1,
) -> PadCollate:
    """A `collate_fn` that pads each field of the samples to the longest in the micro-batch.

    Samples are dicts of fields, tuples (or lists) of fields, or a single field. A field's
    values are tensors, NumPy arrays, Python lists of numbers or numbers; strings and other
    objects are returned as a list. Fields whose values all have one shape are stacked; a
    field whose values differ in size is padded, in every dimension, to the largest, with
    its pad value. For example, for a tagger:

        collate_fn = pad_collate(pad={"input_ids": 0, "labels": -100}, mask=True)
        # [{"input_ids": [5, 3, 9], "labels": [1, 0, 2]}, {"input_ids": [7], "labels": [4]}]
        # -> {"input_ids": (2, 3), "labels": (2, 3) with -100 at padding,
        #     "attention_mask": (2, 3) of 1 and 0}

    Pad labels with -100 (`IGNORE_INDEX`): the built-in tasks then count no loss item there.

    Args:
        pad: the pad value of each field (`{name: value}` for dicts, `{index: value}` or a
            sequence such as `(0.0, -100)` for tuples), or one value for every field. A field
            without a pad value must have the same shape in every sample.
        lengths: add each sample's length (`int64`, shape `(B,)`): `True` names it
            `lengths`, a string names it. Tuple samples get it appended after their fields.
        mask: add a `(B, L)` `int64` mask, 1 at real positions and 0 at padding: `True`
            names it `attention_mask`, a string names it; appended after `lengths` for tuples.
        length_of: the field whose dim-0 size is the length (default: the first padded field).
        pad_to_multiple_of: round the padded dim 0 up to a multiple of this (e.g. 8 for
            tensor cores).
    """
    return PadCollate(
        pad, lengths=lengths, mask=mask, length_of=length_of, pad_to_multiple_of=pad_to_multiple_of
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Number)


def _is_fields(sample: Any) -> bool:
    """A tuple is always a sample of fields; a list is one unless it holds numbers only."""
    if isinstance(sample, tuple):
        return True
    if isinstance(sample, list):
        return not all(_is_number(v) for v in sample)
    return False


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, str | bytes) or value is None:
        return None
    if isinstance(value, list) and not value:
        # torch reads [] as float32; an empty list is far more often ids or labels.
        return torch.zeros(0, dtype=torch.int64)
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None
