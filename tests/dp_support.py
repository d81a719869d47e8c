"""A float64 model and data for tests/test_dp_sgd.py, built by the trainer from `_target_`
(`model._target_=tests.dp_support.mlp64`, `data._target_=tests.dp_support.blobs`): the
trainer has no float64 option, and DP-SGD's exactness is checked to 1e-10.

Light imports only: trainer subprocesses import this module to build these objects.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

FEATURES, CLASSES = 6, 3


def mlp64(hidden: int = 16, batch_norm: bool = False) -> nn.Module:
    """A small float64 classifier; `batch_norm` adds the layer DP-SGD must refuse."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(FEATURES, hidden)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(hidden))
    layers += [nn.Tanh(), nn.Linear(hidden, CLASSES)]
    return nn.Sequential(*layers).double()


def blobs(n_train: int = 256, n_val: int = 64) -> dict[str, TensorDataset]:
    """Noisy Gaussian blobs, float64 features and int64 labels, from a fixed generator."""
    gen = torch.Generator().manual_seed(3)
    n = n_train + n_val
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    centers = 2.0 * torch.randn(CLASSES, FEATURES, generator=gen, dtype=torch.float64)
    x = centers[labels] + torch.randn(n, FEATURES, generator=gen, dtype=torch.float64)
    return {
        "train": TensorDataset(x[:n_train], labels[:n_train]),
        "val": TensorDataset(x[n_train:], labels[n_train:]),
    }
