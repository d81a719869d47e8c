"""The modes of `moe.balance` as small strategies. Each mode declares what it needs and gives
each micro-batch's share of its losses; engine/moe/balance.py's `BalancedTask` runs them.

A mode declares what it needs:

- `prepare`: work before any backward, once per window. `global` runs its routing pass here.
  `needs` names that work for the refusal of a step that does not prepare windows.
- `routing_pass`: the step's routing is counted before backward and checked after.
- `moves_bias`: the routers' biases are updated after each step from its counts.

Each mode's `share(micro, window, objective)` is this micro-batch's part of the auxiliary
loss (before `moe.aux_coef`) and of the z-loss (before `moe.z_coef`). Summed over the step's
micro-batches and ranks, the shares are the mode's losses. The model's objective
(engine/moe/objective.py: per layer, or transformers' pooled) is the formula every mode
shares, as Megatron's aux-loss kinds share `switch_load_balancing_loss_func`. The mode only
chooses its counts and its denominators. A new mode is one class here and its name in
engine/moe/modes.py (tests/test_moe.py checks that the two agree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from engine.moe.modes import BALANCE_MODES
from engine.moe.objective import BalanceObjective
from engine.moe.routing import HALF
from engine.moe.sums import LayerSums, MicroRouting, StepSums, Window, routed_mask
from engine.parallel.base import WindowGuard


class Share(NamedTuple):
    """One micro-batch's share of the auxiliary loss and of the z-loss (None: no such term),
    unweighted. The balancing divides neither: the shares carry their denominators."""

    aux: torch.Tensor | None
    z: torch.Tensor | None


class StepCounter(Protocol):
    """What a mode's `prepare` may ask of the balanced task: the routing pass with its one
    all-reduce (`count_step`), or an all-reduce of its own sums over the data-parallel ranks."""

    def count_step(self, ctx: Any, window: Window, guard: WindowGuard) -> StepSums: ...

    def all_reduce(self, flat: torch.Tensor) -> torch.Tensor: ...


def z_share(sums: LayerSums, tokens: torch.Tensor, divisor: int = 1) -> torch.Tensor:
    """This micro-batch's part of z = the mean over the layers of the mean squared logsumexp
    over `tokens`, divided by `divisor`."""
    layers = sums.lse2.shape[0]
    return sums.lse2.sum() / (tokens.to(sums.lse2.dtype).clamp(min=1) * layers) / divisor


class Balance:
    """A mode of `moe.balance` (the module's docstring); as a class, it adds no loss."""

    name: ClassVar[str]
    needs: ClassVar[str] = ""  # what `prepare` does, for a refusal; "" when nothing
    routing_pass: ClassVar[bool] = False
    moves_bias: ClassVar[bool] = False

    def prepare(self, task: StepCounter, ctx: Any, window: Window, guard: WindowGuard) -> Window:
        """Before any backward of `window`: the window, with what this mode counted."""
        del task, ctx, guard
        return window

    def share(self, micro: MicroRouting, window: Window, objective: BalanceObjective) -> Share:
        del micro, window, objective
        return Share(None, None)

    def own(self, share: Share) -> torch.Tensor | None:
        """Values summed over the step's micro-batches and ranks with the routing's sums, for
        this mode's records (`records`); None: nothing of its own."""
        del share
        return None

    def records(self, step: StepSums, window: Window) -> dict[str, torch.Tensor]:
        """Records of its own, beside the whole step's aux, z-loss and load."""
        del step, window
        return {}


class Global(Balance):
    """The whole step's f and P, exact: f counted by a routing pass before any backward."""

    name = "global"
    needs = "counts the whole window's routing before any backward"
    routing_pass = True

    def prepare(self, task: StepCounter, ctx: Any, window: Window, guard: WindowGuard) -> Window:
        return dataclasses.replace(window, step=task.count_step(ctx, window, guard))

    def share(self, micro: MicroRouting, window: Window, objective: BalanceObjective) -> Share:
        step = window.step
        assert step is not None  # `prepare` counted it
        aux = objective.aux(step.counts, micro.sums.probs, step.tokens, micro.top_k)
        return Share(aux, z_share(micro.sums, step.tokens))


class Micro(Balance):
    """Each micro-batch's own f and P, its losses averaged over the step's micro-batches (what
    transformers and DeepSpeed do under accumulation): an approximation that depends on the
    split."""

    name = "micro"

    def share(self, micro: MicroRouting, window: Window, objective: BalanceObjective) -> Share:
        s, n = micro.sums, window.micro_batches
        aux = objective.aux(s.counts, s.probs, s.tokens, micro.top_k) / n
        return Share(aux, z_share(s, s.tokens, n))


class Bias(Balance):
    """No auxiliary loss: each router's bias moves after the step from its counts
    (DeepSeek-V3); the z-loss as `micro`'s."""

    name = "bias"
    moves_bias = True

    def share(self, micro: MicroRouting, window: Window, objective: BalanceObjective) -> Share:
        del objective
        return Share(None, z_share(micro.sums, micro.sums.tokens, window.micro_batches))


class NoBalance(Balance):
    """No balancing loss, no z-loss (the records still show the load)."""

    name = "none"


@dataclass(frozen=True)
class Sequences:
    """`seq_aux`'s counts of the whole step (float64, every micro-batch and rank): the
    sequences that hold a counted token, and the counted tokens."""

    sequences: torch.Tensor
    tokens: torch.Tensor


class SeqAux(Balance):
    """Megatron's sequence-level auxiliary loss (`seq_aux_loss`): the objective of each
    sequence's own f and P, averaged over the whole step's sequences. It is exact under
    accumulation because the step's value is a sum over its sequences: a micro-batch's share
    needs only the global count of sequences, counted before any backward (one all-reduce of
    two numbers, no routing pass). The z-loss is the whole step's, as with `global`. A
    sequence is a row of the batch's input (B, T); a row without counted tokens is none."""

    name = "seq_aux"
    needs = "counts the whole step's sequences before any backward"

    def prepare(self, task: StepCounter, ctx: Any, window: Window, guard: WindowGuard) -> Window:
        del ctx, guard
        counted = []
        for batch in window.batches:
            rows = routed_rows(batch)  # (B, T)
            counted.append(torch.stack([rows.any(-1).sum(), rows.sum()]).to(torch.float64))
        total = task.all_reduce(torch.stack(counted).sum(0))
        return dataclasses.replace(window, prepared=Sequences(total[0], total[1]))

    def share(self, micro: MicroRouting, window: Window, objective: BalanceObjective) -> Share:
        step = window.prepared
        assert isinstance(step, Sequences)  # `prepare` counted them
        counts, probs, tokens = sequence_sums(micro)  # (B, L, E), (B, L, E), (B,)
        per_sequence = objective.aux(counts, probs, tokens, micro.top_k)  # (B,)
        aux = per_sequence.sum() / step.sequences.clamp(min=1).to(per_sequence.dtype)
        return Share(aux, z_share(micro.sums, step.tokens))

    def own(self, share: Share) -> torch.Tensor | None:
        assert share.aux is not None
        return share.aux.detach().to(torch.float64)

    def records(self, step: StepSums, window: Window) -> dict[str, torch.Tensor]:
        del window
        return {} if step.own is None else {"train/moe_seq_aux_loss": step.own[0]}


def batch_shape(batch: Any) -> tuple[int, int] | None:
    """(sequences, positions) of a batch's input: a tuple batch's inputs (B, T), a dict
    batch's `input_ids` or `attention_mask` (B, T); None for any other batch."""
    inputs: Any = None
    if isinstance(batch, Mapping):
        inputs = batch.get("input_ids", batch.get("attention_mask"))
    elif isinstance(batch, tuple | list) and len(batch) == 2:
        inputs = batch[0]
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2:
        return inputs.shape[0], inputs.numel()
    return None


def routed_rows(batch: Any, n: int | None = None) -> torch.Tensor:
    """(B, T) bool: `routed_mask` by sequence, for a batch of B sequences whose n routed
    positions are its input's, in order (n: the input's positions when None)."""
    shape = batch_shape(batch)
    if shape is None or (n is not None and shape[1] != n):
        got = "no (B, T) input" if shape is None else f"an input of {shape[1]} positions"
        raise ValueError(
            "moe.balance=seq_aux takes the balancing loss per sequence: it needs batches whose "
            "input is (B, T) (a tuple's inputs, a dict's input_ids or attention_mask), routed "
            f"position by position, got {got}" + ("" if n is None else f" and {n} routed")
        )
    return routed_mask(batch, shape[1]).view(shape[0], -1)


def sequence_sums(micro: MicroRouting) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence of the micro-batch: assignments (B, L, E), summed probabilities (B, L, E)
    with their graph, counted tokens (B,): `LayerSums` row by row, at once."""
    rows = routed_rows(micro.batch, micro.routings[0].logits.shape[0])  # (B, T)
    B, T = rows.shape
    counts, probs = [], []
    for r in micro.routings:
        logits = r.logits.float() if r.logits.dtype in HALF else r.logits  # (N, E)
        m = rows.to(logits.device).reshape(-1)  # (N,)
        E, k = logits.shape[-1], r.experts.shape[-1]
        row = torch.arange(B, device=logits.device).repeat_interleave(T * k)  # (N*k,)
        slots = m.to(torch.int64).repeat_interleave(k)  # 1 where the token counts
        zeros = torch.zeros(B * E, dtype=torch.int64, device=logits.device)
        index = row * E + r.experts.reshape(-1)
        counts.append(zeros.scatter_add(0, index, slots).view(B, E))
        p = torch.where(m.unsqueeze(-1), F.softmax(logits, dim=-1), 0.0)  # (N, E)
        probs.append(p.view(B, T, E).sum(1))
    tokens = rows.sum(-1).to(probs[0].device)
    return torch.stack(counts, 1), torch.stack(probs, 1), tokens


STRATEGIES: dict[str, type[Balance]] = {
    cls.name: cls for cls in (Global, Micro, Bias, NoBalance, SeqAux)
}


def strategy(name: str) -> Balance:
    """The mode named `name` (`moe.balance`)."""
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(
            f"balance must be one of {', '.join(BALANCE_MODES)}, got {name!r}"
        ) from None
