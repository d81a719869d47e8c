"""The GPUs `trainer.plan` can plan for: memory, dense peak FLOP/s and link bandwidths.

Memory is what CUDA reports, `torch.cuda.get_device_properties(i).total_memory` (the
driver's `totalGlobalMem`), not the marketing figure: an "80GB" H100 has 85,029,158,912
bytes (79.2 GiB), not 80e9. Where the figures come from:
- h100 (H100 SXM 80GB HBM3): 85,029,158,912 bytes, `total_memory` on an H100 80GB;
- h200 (H200 141GB HBM3e): 150,109,880,320 bytes, `total_memory` on an H200 (driver 580.159,
  torch 2.11.0+cu130, read on 2026-11-27 by scripts/gpu_finetune_checks.py);
- a100 (A100-SXM4-80GB): 85,100,068,864 bytes, CUDA's deviceQuery sample under a 12.5
  driver (a 12.2 driver reported 84,987,740,160: the driver keeps a little, ~0.1%);
- a100_40 (A100-SXM4-40GB): 42,298,834,944 bytes, deviceQuery, 12.2 driver;
- l4: 23,612,293,120 bytes, deviceQuery, 12.0 driver;
- a10: 23,609,475,072 bytes, deviceQuery, 12.2 driver.
`plan.memory_bytes` overrides them (another board, driver, or MIG slice).

FLOP/s and links are vendors' data-sheet numbers (dense, no sparsity): the planner's time
estimate is an estimate built on them and on the efficiency assumptions of
trainer/planning/estimate.py, stated in docs/plan.md, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # as CUDA reports it (total_memory)
    bf16_flops: float  # dense bf16/fp16 tensor-core peak, FLOP/s
    fp32_flops: float  # dense TF32 tensor-core peak (what fp32 matmuls get), FLOP/s
    node_link: float  # bytes/s between GPUs of a node (NVLink; PCIe without it)
    net_link: float  # bytes/s per GPU between nodes (InfiniBand / RoCE)


GPUS = {
    g.name: g
    for g in (
        GPU("h100", 85_029_158_912, 989e12, 494.5e12, 450e9, 50e9),
        GPU("h200", 150_109_880_320, 989e12, 494.5e12, 450e9, 50e9),
        GPU("a100", 85_100_068_864, 312e12, 156e12, 300e9, 25e9),
        GPU("a100_40", 42_298_834_944, 312e12, 156e12, 300e9, 25e9),
        GPU("l4", 23_612_293_120, 121e12, 60e12, 32e9, 12.5e9),
        GPU("a10", 23_609_475_072, 125e12, 62.5e12, 32e9, 12.5e9),
    )
}
