"""`trainer.data.pad_collate`: each field padded to the longest with its own value, against
batches written out by hand."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from trainer.data import pad_collate


def test_dict_samples_pad_each_field_with_its_own_value() -> None:
    """Python lists of ids and labels, a fixed-size field, an int and a string: ids pad with 0,
    labels with -100, the rest stack (or stay a list); lengths and mask are those of ids."""
    collate = pad_collate(pad={"input_ids": 0, "labels": -100}, lengths=True, mask=True)
    batch = collate(
        [
            {"input_ids": [5, 3, 9], "labels": [1, 0, 2], "x": torch.ones(2), "y": 3, "id": "a"},
            {"input_ids": [7], "labels": [4], "x": torch.zeros(2), "y": 4, "id": "b"},
            {"input_ids": [], "labels": [], "x": torch.ones(2), "y": 5, "id": "c"},
        ]
    )
    assert list(batch) == ["input_ids", "labels", "x", "y", "id", "lengths", "attention_mask"]
    assert batch["input_ids"].tolist() == [[5, 3, 9], [7, 0, 0], [0, 0, 0]]
    assert batch["labels"].tolist() == [[1, 0, 2], [4, -100, -100], [-100, -100, -100]]
    assert batch["input_ids"].dtype == torch.int64
    assert batch["x"].tolist() == [[1, 1], [0, 0], [1, 1]]
    assert batch["y"].tolist() == [3, 4, 5]
    assert batch["id"] == ["a", "b", "c"]
    assert batch["lengths"].tolist() == [3, 1, 0]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]


def test_tuple_samples_pad_every_dimension() -> None:
    """(features (T, F), tags (T,)) tuples with a sequence of pad values: features pad along
    T with 0.0, tags with -100; lengths are appended after the fields."""
    rng = np.random.default_rng(0)
    xs = [torch.randn(n, 3) for n in (2, 4, 1)]
    ys = [torch.as_tensor(rng.integers(0, 4, n)) for n in (2, 4, 1)]
    x, y, lengths = pad_collate((0.0, -100), lengths=True)(list(zip(xs, ys)))
    assert x.shape == (3, 4, 3) and y.shape == (3, 4)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        n = len(yi)
        assert torch.equal(x[i, :n], xi) and torch.equal(x[i, n:], torch.zeros(4 - n, 3))
        assert y[i, :n].tolist() == yi.tolist() and set(y[i, n:].tolist()) <= {-100}
    assert lengths.tolist() == [2, 4, 1]
    # Both dimensions differ (images of different sizes): padded to the largest in each.
    (img,) = pad_collate(-1)([(torch.ones(1, 3),), (torch.ones(2, 1),)])
    assert img.tolist() == [[[1, 1, 1], [-1, -1, -1]], [[1, -1, -1], [1, -1, -1]]]


def test_single_field_samples_and_multiple_of() -> None:
    """A dataset returning bare lists of token ids; `pad_to_multiple_of` rounds the length."""
    ids, mask = pad_collate(0, mask="mask", pad_to_multiple_of=4)([[1, 2, 3, 4, 5], [6]])
    assert ids.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 0, 0, 0, 0, 0, 0, 0]]
    assert mask.tolist() == [[1] * 5 + [0] * 3, [1] + [0] * 7]
    same = pad_collate(0)([torch.arange(3), torch.arange(3)])
    assert torch.equal(same, torch.stack([torch.arange(3)] * 2))
    # A micro-batch of empty sequences (no loss item at all) still has integer labels.
    empty = pad_collate({"labels": -100})([{"labels": []}, {"labels": []}])["labels"]
    assert empty.shape == (2, 0) and empty.dtype == torch.int64


def test_mistakes_name_the_field_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"field 'labels'.*pad_collate\(pad=\{'labels': 0\}\)"):
        pad_collate(pad={"ids": 0})(
            [{"ids": [1], "labels": [1]}, {"ids": [1, 2], "labels": [1, 2]}]
        )
    with pytest.raises(ValueError, match=r"pad names \['label'\].*\['ids', 'labels'\]"):
        pad_collate(pad={"label": -100})([{"ids": [1], "labels": [1]}])
    # The same fields in another order are the same fields.
    swapped = pad_collate(pad={"a": 0})([{"a": [1, 2], "b": 1}, {"b": 2, "a": [3]}])
    assert swapped["a"].tolist() == [[1, 2], [3, 0]] and swapped["b"].tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"same fields"):
        pad_collate(pad=0)([{"ids": [1]}, {"ids": [1], "extra": 2}])
    with pytest.raises(ValueError, match=r"pad_collate\(pad=0\)"):
        pad_collate()([[1, 2], [3]])


def test_pickles_for_loader_workers() -> None:
    """Spawned DataLoader workers receive the collate function pickled."""
    collate = pickle.loads(pickle.dumps(pad_collate(pad={"a": 0}, lengths=True)))
    assert collate([{"a": [1, 2]}, {"a": [3]}])["lengths"].tolist() == [2, 1]
