"""Whole documents packed into rows of at most `capacity` tokens: best-fit decreasing over a
buffer, deterministic from the seed, a document never split.

The documents are shuffled once (seeded), then taken a buffer at a time: each buffer's
documents, longest first, go to the open row whose free space fits them most tightly, or to a
new row. Rows close at the end of their buffer, so memory and time stay bounded per buffer
and the result depends only on (lengths, capacity, seed).
"""

from __future__ import annotations

import bisect

import numpy as np

BUFFER = 4096  # documents packed together: larger packs tighter, costs more per document


def pack(
    lengths: np.ndarray, capacity: int, seed: int, buffer: int = BUFFER
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of documents as CSR arrays: row r holds `docs[row_ptr[r]:row_ptr[r + 1]]`
    (indices into `lengths`), at most `capacity` tokens in all. Every length must be at most
    `capacity`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f"a document of {int(lengths.max())} tokens exceeds rows of {capacity}")
    order = np.random.default_rng([seed, 0x9AC4]).permutation(len(lengths))
    rows: list[list[int]] = []
    for lo in range(0, len(order), buffer):
        part = order[lo : lo + buffer]
        part = part[np.argsort(-lengths[part], kind="stable")]  # longest first
        rows += _best_fit(part, lengths, capacity)
    row_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    row_ptr[1:] = np.cumsum([len(r) for r in rows])
    docs = np.fromiter((d for r in rows for d in r), dtype=np.int64, count=int(row_ptr[-1]))
    return row_ptr, docs


def _best_fit(part: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Each document into the open row with the least free space that holds it."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for d in part.tolist():
        n = int(lengths[d])
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):  # no open row holds it: a new row
            rows.append([d])
            bisect.insort(free, (capacity - n, len(rows) - 1))
            continue
        space, r = free.pop(k)
        rows[r].append(d)
        bisect.insort(free, (space - n, r))
    return rows


def one_per_row(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Unpacked: document i alone in row i."""
    return np.arange(n + 1, dtype=np.int64), np.arange(n, dtype=np.int64)
