"""Launched by tests/test_expert_parallel.py on 2 ranks (gloo): one mixture split over both
ranks (dist.ep=2) against the unsplit mixture, with every token routed to experts 0 and 1
(rank 0's): rank 1 receives an empty split in both all-to-alls and still takes part.

Each rank feeds its own tokens; the split layer's outputs and input gradients must equal the
unsplit layer's on the same tokens, and each rank's experts' gradient must equal the unsplit
experts' gradient summed over both ranks' tokens (the slice it holds). Exit 0 when they do.

`run_args`, `dump` and `assert_split_update`: what the ep tests of the in-tree and of
transformers' mixtures share (the runs' arguments, and the check of step 1's update)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel.expert import ExpertGroup, distribute_experts
from trainer.models.moe import MoE, MoEConfig


def run_args(text: Path, model: list[str]) -> list[str]:
    """4 steps of one global batch of 24 samples of `text` on the mixture `model` (SGD with
    momentum, clipping that acts, moe.balance=global with large aux and z weights),
    checkpoints and evaluations every 2 steps."""
    from tests.conftest import TINY

    return [
        *TINY,
        *model,
        "moe=global",
        "moe.aux_coef=1.0",
        "moe.z_coef=0.1",
        f"data.path={text}",
        "data.block_size=64",
        "optim=sgd",
        "optim.lr=0.1",
        "optim.momentum=0.9",
        "scheduler=constant",
        "scheduler.warmup_steps=0",
        "train.clip_grad_norm=1.0",  # the step-1 norm is ~1.6: clipping acts
        "train.global_batch_size=24",
        "train.micro_batch_size=3",
        "train.max_steps=4",
        "checkpoint.every_steps=2",
        "eval.every_steps=2",
        "eval.max_batches=2",
    ]


def dump(run_dir: Path) -> str:
    """The override that writes each rank's step-1 weights and gradients to `run_dir`."""
    target = "tests.moe_support.DumpFirstStepPerRank"
    return f"+callbacks.dump={{_target_: {target}, path: {run_dir}/step1.pt}}"


def assert_split_update(
    want: dict[str, Any], ranks: list[dict[str, Any]], replicas: list[dict[str, Any]], rel: float
) -> list[str]:
    """Step 1's weights and applied gradient of an ep=2 run (the dumps of ranks 0 and 1)
    against one process's `want`: each rank holds half the experts of every block
    (`.mlp.experts.` in the name), joined they are the one process's, to `rel` of the
    largest entry; every other parameter is the same on both ranks; `replicas` (ranks 2 and
    3 of 4, if any) hold what ranks 0 and 1 do. The expert parameters' names."""
    for r, replica in enumerate(replicas):
        assert replica["grads"].keys() == ranks[r]["grads"].keys()
        for n, g in replica["grads"].items():
            assert torch.equal(g, ranks[r]["grads"][n]), (r + 2, n)
    experts = [n for n in want["grads"] if ".mlp.experts." in n]
    for name, w in want["grads"].items():
        if name in experts:
            parts = [d["grads"][name] for d in ranks]
            assert 2 * parts[0].shape[0] == w.shape[0], (name, parts[0].shape)
            got = torch.cat(parts)
            weights = torch.cat([d["weights"][name] for d in ranks])
        else:
            got, weights = ranks[0]["grads"][name], ranks[0]["weights"][name]
            assert torch.equal(ranks[1]["grads"][name], got), name  # replicas agree
        assert torch.equal(weights, want["weights"][name]), name
        err = ((got - w).abs().max() / w.abs().max()).item()
        assert err <= rel, f"{name}: relative error {err:.2e}"
    return experts


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    whole = MoE(16, MoEConfig(experts=8, top_k=2, hidden=24), bias=True, dropout=0.0)
    whole.init_weights(2)
    with torch.no_grad():
        whole.router.bias[:2] = 10.0  # experts 0 and 1 win every token: rank 1 gets none
    split = copy.deepcopy(whole)
    group = ExpertGroup(dist.group.WORLD, 2, rank, 4)
    kept = distribute_experts(split.experts.expert_layer(), group)
    torch.manual_seed(1 + rank)
    x = torch.randn(2, 5, 16, dtype=torch.float32)  # (B, T, C), this rank's own tokens
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = whole(xa), split(xb)
    (ya.square().sum()).backward()
    (yb.square().sum()).backward()
    routed = split.router.routing
    assert routed is not None and int(routed.experts.max()) <= 1, routed.experts
    torch.testing.assert_close(yb, ya, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-6, atol=1e-6)
    mine = slice(4 * rank, 4 * rank + 4)
    for name, p in (("fc", whole.experts.fc), ("proj", whole.experts.proj)):
        want = p.grad.clone()
        dist.all_reduce(want)
        got = kept[0].grad if name == "fc" else kept[1].grad
        torch.testing.assert_close(got, want[mine], rtol=1e-6, atol=1e-7)
    if rank == 1:
        assert not kept[0].grad.any(), "rank 1's experts received tokens"
    dist.destroy_process_group()
    print(f"rank {rank}: empty split ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
