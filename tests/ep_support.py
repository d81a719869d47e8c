"""Launched by tests/test_expert_parallel.py on 2 ranks (gloo): one mixture split over both
ranks (dist.ep=2) against the unsplit mixture, with every token routed to experts 0 and 1
(rank 0's): rank 1 receives an empty split in both all-to-alls and still takes part.

Each rank feeds its own tokens; the split layer's outputs and input gradients must equal the
unsplit layer's on the same tokens, and each rank's experts' gradient must equal the unsplit
experts' gradient summed over both ranks' tokens (the slice it holds). Exit 0 when they do."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from engine.parallel.expert import ExpertGroup
from trainer.models.moe import MoE, MoEConfig


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
    kept = split.split_experts(group)
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
