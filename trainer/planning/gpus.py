"""The GPUs `trainer.plan` can plan for: memory, dense peak FLOP/s and link bandwidths.

Figures are vendors' data-sheet numbers (dense, no sparsity): the planner's time estimate is
an estimate built on them and on the efficiency assumptions of
trainer/planning/simulate.py, stated in docs/plan.md, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bf16_flops: float  # dense bf16/fp16 tensor-core peak, FLOP/s
    fp32_flops: float  # dense TF32 tensor-core peak (what fp32 matmuls get), FLOP/s
    node_link: float  # bytes/s between GPUs of a node (NVLink; PCIe without it)
    net_link: float  # bytes/s per GPU between nodes (InfiniBand / RoCE)


GPUS = {
    g.name: g
    for g in (
        GPU("h100", 80 * 10**9, 989e12, 494.5e12, 450e9, 50e9),
        GPU("h200", 141 * 10**9, 989e12, 494.5e12, 450e9, 50e9),
        GPU("a100", 80 * 10**9, 312e12, 156e12, 300e9, 25e9),
        GPU("a100_40", 40 * 10**9, 312e12, 156e12, 300e9, 25e9),
        GPU("l4", 24 * 10**9, 121e12, 60e12, 32e9, 12.5e9),
        GPU("a10", 24 * 10**9, 125e12, 62.5e12, 32e9, 12.5e9),
    )
}
