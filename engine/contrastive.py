"""`task=contrastive`: InfoNCE with in-batch negatives over the whole global batch.

Each sample is a pair (anchor, positive). The model embeds both; embeddings are
L2-normalized, `logits[i, j] = cos(a_i, p_j) / tau` over every pair of the window (every
micro-batch, every data-parallel rank), and the loss is `mean_i CE(logits[i], i)`: each
anchor must pick its own positive among all the window's positives. `symmetric` adds the
positives -> anchors direction and averages the two. `learn_temperature` learns
`tau = exp(-s)` with `s = log(1 / tau)` the parameter (CLIP's parametrization), owned by the
task (engine/window_task.py's `loss_module`) and trained with the model.

Batches are dicts of `input_ids` and `attention_mask` of shape (samples, 2, length): row
`[i, 0]` the anchor, `[i, 1]` the positive (trainer/data/pairs.py). The model is called once
per micro-batch on the (2 x samples, length) rows and must return one embedding per row
(`model=hf_encoder` mean-pools over the attention mask). The loss is of the whole window
(`WindowTask`), so it trains with `step=cached`; evaluation takes the evaluation batch's
candidates as negatives, gathered over the ranks as in training (`val/loss`, and
`val/accuracy@1`: anchors whose nearest positive is their own), the same on any world size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.tasks import TaskOutputError


class LogitScale(nn.Module):
    """`s = log(1 / tau)`, the learned temperature's parameter: logits are multiplied by
    `exp(s)`."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(1.0 / temperature)))

    def forward(self) -> torch.Tensor:
        return self.log_scale.exp()


class ContrastiveTask:
    """Args:
    temperature: tau, the initial one when learned.
    learn_temperature: learn tau (as `s = log(1/tau)`).
    symmetric: average anchors -> positives with positives -> anchors.
    """

    name = "task=contrastive"
    unit = "pairs"  # a loss item: one (anchor, positive) pair

    def __init__(
        self,
        temperature: float = 0.05,
        learn_temperature: bool = False,
        symmetric: bool = False,
    ) -> None:
        if not (isinstance(temperature, int | float) and temperature > 0):
            raise ValueError(f"temperature must be a positive number, got {temperature!r}")
        self.temperature = float(temperature)
        self.symmetric = bool(symmetric)
        self.scale = LogitScale(self.temperature) if learn_temperature else None

    # ---- what the step asks (engine/window_task.py) ----
    def loss_module(self) -> nn.Module | None:
        return self.scale

    def count_items(self, batch: Any) -> torch.Tensor:
        ids, _ = self._inputs(batch)
        return torch.tensor(ids.shape[0], dtype=torch.int64)

    def represent(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """(samples, 2, dim): each pair's anchor and positive embeddings, L2-normalized."""
        ids, mask = self._inputs(batch)
        n, length = ids.shape[0], ids.shape[-1]
        # One forward of 2n rows (anchor, positive, anchor, ...): DDP and FSDP see one.
        out = model(input_ids=ids.reshape(2 * n, length), attention_mask=mask.reshape(2 * n, -1))
        if not (isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == 2 * n):
            got = (
                f"a tensor of shape {tuple(out.shape)}"
                if isinstance(out, torch.Tensor)
                else f"a {type(out).__name__}"
            )
            raise TaskOutputError(
                f"{self.name} reads one embedding per row from the model: "
                f"forward(input_ids, attention_mask) on ({2 * n}, {length}) rows must return a "
                f"({2 * n}, dim) tensor; the model returned {got}. model=hf_encoder does"
            )
        wide = out if out.dtype == torch.float64 else out.float()
        return F.normalize(wide, dim=-1).view(n, 2, -1)

    def window_loss(self, reps: torch.Tensor, rows: slice) -> torch.Tensor:
        """Summed cross-entropy of anchors `rows` against every positive of the window (and,
        symmetric, positives `rows` against every anchor, averaged)."""
        anchors, positives = reps[:, 0], reps[:, 1]  # (N, dim) each
        targets = torch.arange(rows.start, rows.stop, device=reps.device)
        scale = self.logit_scale(reps)
        # (rows, N): this chunk's logits only.
        loss = F.cross_entropy(scale * anchors[rows] @ positives.T, targets, reduction="sum")
        if self.symmetric:
            back = F.cross_entropy(scale * positives[rows] @ anchors.T, targets, reduction="sum")
            loss = (loss + back) / 2
        return loss

    def logit_scale(self, like: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return torch.tensor(1.0 / self.temperature, dtype=like.dtype, device=like.device)
        return self.scale().to(like.dtype)

    # ---- evaluation, and a batch alone ----
    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss of `batch` with its own samples as the only negatives (what evaluation
        reports; training uses the whole window's through `step=cached`)."""
        reps = self.represent(model, batch)
        return self.window_loss(reps, slice(0, reps.shape[0]))

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        reps = self.represent(model, batch)
        return self.window_metrics(reps, slice(0, reps.shape[0]))

    def window_metrics(self, reps: torch.Tensor, rows: slice) -> dict[str, torch.Tensor]:
        """The loss of anchors `rows` against every positive of the evaluation batch `reps`,
        and how many of them are nearest to their own positive (`accuracy@1`)."""
        similarity = reps[rows, 0] @ reps[:, 1].T  # (rows, batch)
        own = torch.arange(rows.start, rows.stop, device=reps.device)
        hits = similarity.argmax(dim=-1) == own
        return {"loss": self.window_loss(reps, rows), "accuracy@1": hits.sum()}

    def metrics(self) -> dict[str, torch.Tensor]:
        """`train/temperature` when learned: tau after the step's update."""
        if self.scale is None:
            return {}
        return {"train/temperature": torch.exp(-self.scale.log_scale.detach())}

    def _inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 3 and ids.shape[1] == 2):
            raise TaskOutputError(
                f"{self.name}: a batch must be a dict with `input_ids` and `attention_mask` of "
                "shape (samples, 2, length): each sample's anchor and positive (data=pairs)"
            )
        if mask is None:
            mask = torch.ones_like(ids)
        return ids, mask
