"""`TextSequence`: one row of documents (packed conversations), aligned for next-token
prediction, the value that training and `trainer.preview` both read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.tasks import IGNORE_INDEX


@dataclass(frozen=True)
class TextSequence:
    """A row's tokens with the token each position predicts.

    Who aligns: the encoder decides which tokens are targets (trainer/data/chat_encode.py:
    `target_mask`, a supervised token predicted from the one before it); `from_documents`
    alone turns those marks into `labels`, and training (`as_sample`) and trainer.preview
    (`targets`, `documents`) read them from here.

    Attributes:
        input_ids: (T,) int64 token ids.
        labels: (T,) int64: the token position t predicts, `IGNORE_INDEX` where it predicts
            nothing (a token that is not a target follows it, or its document ends).
        positions: (T,) int64: each token's position in its own document (0 where one starts).
    """

    input_ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray

    @classmethod
    def from_documents(cls, documents: Sequence[tuple[np.ndarray, np.ndarray]]) -> TextSequence:
        """The row of `documents`, each (token ids, target mask), in row order."""
        ids, labels, positions = [], [], []
        for tokens, targets in documents:
            # Position t predicts token t + 1 of its own document when that one is a target;
            # the last token predicts nothing: no target crosses a boundary.
            shift = np.full(len(tokens), IGNORE_INDEX, np.int64)
            shift[:-1] = np.where(targets[1:] == 1, tokens[1:], IGNORE_INDEX)
            ids.append(np.asarray(tokens, np.int64))
            labels.append(shift)
            positions.append(np.arange(len(tokens), dtype=np.int64))
        empty = [np.zeros(0, np.int64)]
        return cls(
            np.concatenate(ids or empty),
            np.concatenate(labels or empty),
            np.concatenate(positions or empty),
        )

    def targets(self) -> np.ndarray:
        """(T,) bool: token t is a target (position t - 1 predicts it)."""
        out = np.zeros(len(self.input_ids), bool)
        out[1:] = self.labels[:-1] != IGNORE_INDEX
        return out

    def documents(self) -> list[slice]:
        """Each document's slice of the row, in row order."""
        starts = np.flatnonzero(self.positions == 0).tolist()
        return [slice(a, b) for a, b in zip(starts, [*starts[1:], len(self.positions)])]

    def as_sample(self, packed: bool) -> dict[str, torch.Tensor]:
        """The training sample: `input_ids`, `shift_labels` and, packed, `position_ids`."""
        sample = {
            "input_ids": torch.from_numpy(self.input_ids),
            "shift_labels": torch.from_numpy(self.labels),
        }
        if packed:
            sample["position_ids"] = torch.from_numpy(self.positions)
        return sample
