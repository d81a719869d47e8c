"""task=dpo's losses (`task.loss_type`) as small strategies: each declares what it needs and
gives each pair's loss of its margin. engine/preference.py's `DPOTask` runs them.

A loss declares:

- `needs_reference`: it scores against a reference model (all but `simpo`);
- `length_normalized`: it reads each answer's log-probability divided by its length (`ipo`,
  as TRL's DPOTrainer computes it for ipo; `simpo`).

Its `__call__(margin)` is each pair's loss, (P,), of the pairs' margins: with a reference,
h = (pi_c - ref_c) - (pi_r - ref_r) on the (normalized or summed) log-probabilities; without,
the difference pi_c - pi_r. `beta`, `gamma` and `label_smoothing` (eps) are the task's. A
new loss is one class here, its name in `LOSSES`, and its test: its formula in
tests/test_dpo.py's reference and one run against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PreferenceLoss:
    """A `task.loss_type` (the module's docstring)."""

    beta: float
    gamma: float = 0.5
    label_smoothing: float = 0.0

    name: ClassVar[str]
    needs_reference: ClassVar[bool] = True
    length_normalized: ClassVar[bool] = False

    def __call__(self, margin: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def smoothed(self, x: torch.Tensor) -> torch.Tensor:
        """-(1 - eps) logsigmoid(x) - eps logsigmoid(-x): the logistic loss with eps of the
        preferences assumed flipped (conservative DPO)."""
        eps = self.label_smoothing
        return -(1.0 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


class Sigmoid(PreferenceLoss):
    """DPO (Rafailov et al.): -(1 - eps) logsigmoid(beta h) - eps logsigmoid(-beta h)."""

    name = "sigmoid"

    def __call__(self, margin: torch.Tensor) -> torch.Tensor:
        return self.smoothed(self.beta * margin)


class IPO(PreferenceLoss):
    """IPO (Azar et al.): (h - 1 / (2 beta))^2, on length-normalized log-probabilities."""

    name = "ipo"
    length_normalized = True

    def __call__(self, margin: torch.Tensor) -> torch.Tensor:
        return (margin - 1.0 / (2.0 * self.beta)) ** 2


class SimPO(PreferenceLoss):
    """SimPO (Meng et al., TRL's CPOTrainer): the smoothed logistic loss of beta d - gamma, d
    the difference of the length-normalized log-probabilities; reference-free."""

    name = "simpo"
    needs_reference = False
    length_normalized = True

    def __call__(self, margin: torch.Tensor) -> torch.Tensor:
        return self.smoothed(self.beta * margin - self.gamma)


class Hinge(PreferenceLoss):
    """SLiC's hinge loss (Zhao et al.; TRL's `hinge`): relu(1 - beta h)."""

    name = "hinge"

    def __call__(self, margin: torch.Tensor) -> torch.Tensor:
        return torch.relu(1.0 - self.beta * margin)


class Robust(PreferenceLoss):
    """Robust DPO (Chowdhury et al.; TRL's `robust`), unbiased under preferences flipped with
    probability eps: ((eps - 1) logsigmoid(beta h) + eps logsigmoid(-beta h)) / (1 - 2 eps)."""

    name = "robust"

    def __call__(self, margin: torch.Tensor) -> torch.Tensor:
        eps, x = self.label_smoothing, self.beta * margin
        return (-(1.0 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1.0 - 2.0 * eps)


LOSSES: dict[str, type[PreferenceLoss]] = {
    cls.name: cls for cls in (Sigmoid, IPO, SimPO, Hinge, Robust)
}
LOSS_TYPES = tuple(LOSSES)


def preference_loss(
    name: str, beta: float, gamma: float = 0.5, label_smoothing: float = 0.0
) -> PreferenceLoss:
    """The loss named `name` (`task.loss_type`)."""
    if name not in LOSSES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {name!r}")
    return LOSSES[name](beta, gamma, label_smoothing)
