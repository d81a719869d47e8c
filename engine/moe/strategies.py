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
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from engine.moe.modes import BALANCE_MODES
from engine.moe.objective import BalanceObjective
from engine.moe.sums import LayerSums, MicroRouting, StepSums, Window
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


STRATEGIES: dict[str, type[Balance]] = {cls.name: cls for cls in (Global, Micro, Bias, NoBalance)}


def strategy(name: str) -> Balance:
    """The mode named `name` (`moe.balance`)."""
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(
            f"balance must be one of {', '.join(BALANCE_MODES)}, got {name!r}"
        ) from None
