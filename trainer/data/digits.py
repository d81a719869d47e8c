"""scikit-learn's bundled handwritten digits (`data=digits`): 1,797 8x8 images, no download.

Needs the `sklearn` extra (`pip install -e '.[sklearn]'`).
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from trainer.config.errors import UserError
from trainer.data import DataSplits


def digits(val_every_nth: int = 5) -> DataSplits:
    """Images (1, 8, 8) scaled to [0, 1] and labels 0-9; every `val_every_nth` image (in the
    dataset's fixed order) is held out for validation."""
    if val_every_nth < 2:
        raise ValueError(f"val_every_nth must be at least 2, got {val_every_nth}")
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError(
            "data=digits needs scikit-learn: pip install -e '.[sklearn]'", all_ranks=True
        ) from None
    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(bunch.target, dtype=torch.int64)  # (N,)
    held_out = torch.arange(len(labels)) % val_every_nth == 0
    return DataSplits(
        train=TensorDataset(images[~held_out], labels[~held_out]),
        val=TensorDataset(images[held_out], labels[held_out]),
        description="scikit-learn handwritten digits (8x8)",
    )
