"""Support for tests/test_grpo.py: a step's rollouts built by hand, and a torchrun script that
trains on them with engine objects only on 2 gloo ranks (DDP).

`torchrun --standalone --nproc_per_node=2 -m tests.grpo_support OUT.pt`: each rank takes every
other group of the same rollouts (a group is never split), the advantages scaled by the std of
the whole batch (all-reduced), two SGD steps of micro-batches of 2 completions (the second on
the first's rollouts, its log-probabilities the old policy's, beta > 0 against a frozen copy);
rank 0 saves the gradients each step applied and the records' sums over both ranks.
Heavy imports stay inside functions.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.rl.rollouts import Group

VOCAB, EOS, L_MAX, G = 64, 1, 6, 4
LR = 3.0
EPS, EPS_HIGH = 0.05, 0.08
PROMPTS = (3, 5, 4, 2)
TWO_RANKS = {"loss_type": "dapo", "beta": 0.2, "scale": "batch", "micro": 2}


def make_groups(seed: int, prompt_lengths: Sequence[int], equal_group: int | None) -> list[Group]:
    """Groups of G completions with lengths 1..L_MAX, one truncated per group (L_MAX tokens,
    no end token), the others ending with EOS; two reward functions, scores in tenths; group
    `equal_group` has all rewards equal."""
    import torch

    from engine.rl.rollouts import Group

    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g, p in enumerate(prompt_lengths):
        prompt = torch.randint(2, VOCAB, (p,), generator=gen)
        lengths = torch.randint(1, L_MAX + 1, (G,), generator=gen)
        trunc = g % G
        lengths[trunc] = L_MAX
        completions = torch.randint(2, VOCAB, (G, L_MAX), generator=gen)
        for i in range(G):
            n = int(lengths[i])
            completions[i, n:] = 0
            if i != trunc:
                completions[i, n - 1] = EOS
        truncated = torch.arange(G) == trunc
        rewards = torch.rand(G, 2, generator=gen, dtype=torch.float64).round(decimals=1)
        if g == equal_group:
            rewards[:] = torch.tensor([0.5, 1.0], dtype=torch.float64)
        groups.append(Group(prompt, completions, lengths, truncated, rewards))
    return groups


def weights() -> Any:
    import torch

    return torch.tensor([1.0, 0.5], dtype=torch.float64)


def tiny_gpt() -> Any:
    import torch

    from trainer.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=16)


def two_rank_run(out: str) -> None:
    import torch
    import torch.distributed as dist

    from engine.distributed import all_reduce_max, all_reduce_sum, init_distributed, unwrap
    from engine.numerics.precision import Precision
    from engine.parallel.dims import build_parallelism
    from engine.preference import frozen_copy
    from engine.rl.advantages import group_advantages
    from engine.rl.grpo import GRPOTask
    from engine.rl.rollouts import completion_batches, rollout_sums, weighted_rewards
    from engine.step import CallbackList, StepContext
    from engine.steps.accumulate import AccumulateStep

    info = init_distributed(backend="gloo", device="cpu", timeout_s=60)
    groups = make_groups(11, PROMPTS, equal_group=1)[info.rank :: info.world_size]
    model = tiny_gpt()
    reference = frozen_copy(model)
    ddp = build_parallelism("ddp", info).apply(model)
    task = GRPOTask(
        L_MAX,
        loss_type="dapo",
        epsilon=EPS,
        epsilon_high=EPS_HIGH,
        beta=TWO_RANKS["beta"],
        reference=reference,
        chunk_size=8,
        chunked_vocab_threshold=32,
    )
    over_ranks = lambda t: all_reduce_sum(t, info)  # noqa: E731
    adv = group_advantages(weighted_rewards(groups, weights()), "batch", over_ranks)
    sums, maxima = rollout_sums(groups, adv, weights(), ("first", "second"))
    outputs: list[Any] = []

    class Keeps:  # the integration's thin layer: loss_sum from loss_and_sums, outputs kept
        def count_items(self, batch: Any) -> torch.Tensor:
            return task.count_items(batch)

        def loss_sum(self, model: Any, batch: Any) -> torch.Tensor:
            outputs.append(task.loss_and_sums(model, batch))
            return outputs[-1].loss_sum

    grads: list[dict[str, torch.Tensor]] = []
    params: list[dict[str, torch.Tensor]] = []
    ctx = StepContext(
        model=ddp,
        optimizer=torch.optim.SGD(ddp.parameters(), lr=LR),
        scheduler=None,
        task=Keeps(),  # type: ignore[arg-type]
        precision=Precision("fp32", "cpu"),
        dist=info,
        callbacks=CallbackList(),
    )
    step = AccumulateStep()
    batches = completion_batches(groups, adv.values, TWO_RANKS["micro"], mask_truncated=True)
    for iteration in range(2):
        params.append({k: v.detach().clone() for k, v in unwrap(ddp).state_dict().items()})
        window = batches
        if iteration:  # step 1's log-probabilities, kept per micro-batch, as the old policy's
            window = [{**b, "old_log_probs": o.log_probs} for b, o in zip(batches, outputs)]
            outputs.clear()
        step(ctx, window)
        # The gradient SGD applied: `.grad` stays until the next step's zero_grad.
        grads.append({n: p.grad.detach().clone() for n, p in unwrap(ddp).named_parameters()})
    loss_sums = {k: sum(o.sums[k] for o in outputs) for k in outputs[0].sums}
    total = {k: float(all_reduce_sum(v.double().reshape(1), info)) for k, v in sums.items()}
    total |= {k: float(all_reduce_sum(v.double().reshape(1), info)) for k, v in loss_sums.items()}
    top = {k: float(all_reduce_max(v.double().reshape(1), info)) for k, v in maxima.items()}
    if info.is_main:
        torch.save({"grads": grads, "params": params, "sums": total, "maxima": top}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    two_rank_run(sys.argv[1])
    sys.stderr.flush()
    os._exit(0)
