"""Support for tests/test_distributed.py: callbacks the trainer loads by `_target_`, and a
standalone torchrun script that drives the engine from plain Python.

`torchrun --standalone --nproc_per_node=2 -m tests.dist_support --accum 1 4 8` counts the DDP
comm-hook calls of each micro-batch and prints one JSON object on rank 0's last stdout line.
Heavy imports stay inside functions so that importing a callback from here is cheap.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from engine.callbacks import Callback

if TYPE_CHECKING:
    import torch

    from engine.distributed import DistInfo
    from engine.step import StepContext

MARKER = "COMM_HOOK_COUNTS "


class RaiseOnRank(Callback):
    """Raises on one rank after optimizer step `step`: a worker dying mid-run, peers healthy."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank = rank
        self.step = step

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        if int(os.environ.get("RANK", "0")) == self.rank and step == self.step:
            # The time lets a test measure failure -> job exit independently of startup time.
            raise RuntimeError(
                f"RaiseOnRank: deliberate failure on rank {self.rank} step {step} "
                f"at unix time {time.time():.3f}"
            )


class MicroCounter:
    """Wraps a task's `loss_sum` so a comm hook knows which micro-batch's backward it is in."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.step = 0
        self.micro = -1

    def count_items(self, batch: Any) -> torch.Tensor:
        return self.task.count_items(batch)

    def loss_sum(self, model: Any, batch: Any) -> torch.Tensor:
        self.micro += 1
        return self.task.loss_sum(model, batch)

    def start_step(self, step: int) -> None:
        self.step = step
        self.micro = -1


def synthetic_window(
    step: int, accum: int, micro: int, rank: int, vocab: int, seq: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different data per rank and micro-batch, some padding targets: averaging must matter."""
    import torch

    gen = torch.Generator().manual_seed(1000 * step + 17 * rank + 1)
    window = []
    for _ in range(accum):
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=gen)
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        pad = int(torch.randint(0, seq // 2, (), generator=gen))
        if pad:
            targets[0, -pad:] = -100
        window.append((inputs, targets))
    return window


def run_accum(info: DistInfo, accum: int, steps: int, hooked: bool) -> dict[str, Any]:
    """Train a tiny GPT under DDP for `steps` optimizer steps of `accum` micro-batches.

    With `hooked`, a counting comm hook forwards the buckets (sum then / world size, like DDP's
    default hook); the returned parameters let the caller check that it changed nothing.
    """
    import torch
    import torch.distributed as dist

    from engine.distributed import unwrap
    from engine.numerics.precision import Precision
    from engine.parallel.dims import build_parallelism
    from engine.step import StepContext
    from engine.steps.accumulate import AccumulateStep
    from engine.tasks import CausalLMTask
    from trainer.models.gpt import GPT

    torch.manual_seed(0)
    gpt = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    ddp = build_parallelism("ddp", info).apply(gpt)
    task = MicroCounter(CausalLMTask())
    calls: list[dict[str, int]] = []
    world = info.world_size

    # No annotations on `bucket` or the return: DDP compares them with dist.GradBucket and
    # Future[Tensor] objects, and `from __future__ import annotations` makes them strings.
    def hook(state: object, bucket):  # type: ignore[no-untyped-def]
        del state
        calls.append({"step": task.step, "micro": task.micro, "bucket": bucket.index()})
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / world)

    if hooked:
        ddp.register_comm_hook(state=None, hook=hook)
    ctx = StepContext(
        model=ddp,
        optimizer=torch.optim.SGD(ddp.parameters(), lr=0.5),
        scheduler=None,
        task=task,
        precision=Precision("fp32", "cpu"),
        dist=info,
    )
    step_fn = AccumulateStep()
    for step in range(1, steps + 1):
        task.start_step(step)
        window = synthetic_window(step, accum, 2, info.rank, gpt.vocab_size, gpt.max_seq_len)
        step_fn(ctx, window)
    params = [p.detach().clone() for p in unwrap(ddp).parameters()]
    # Teardown order matters with a Python comm hook under gloo (PLATFORM.md): drop the DDP
    # reducer (and its hook) while every rank is idle, before the process group goes.
    del ctx, step_fn, ddp
    gc.collect()
    dist.barrier()
    return {"calls": calls, "params": params}


def main(argv: list[str] | None = None) -> None:
    """Count comm-hook calls per (step, micro-batch) for each accumulation count."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accum", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from engine.distributed import init_distributed

    info = init_distributed(backend="gloo", device="cpu", timeout_s=60)
    if not info.distributed:
        sys.exit("run under torchrun with --nproc_per_node >= 2")
    result: dict[str, Any] = {"world_size": info.world_size, "runs": {}}
    for accum in args.accum:
        hooked = run_accum(info, accum, args.steps, hooked=True)
        plain = run_accum(info, accum, args.steps, hooked=False)
        diff = max(float((a - b).abs().max()) for a, b in zip(hooked["params"], plain["params"]))
        # Parameters must also agree across ranks: the hook really synchronized gradients.
        flat = torch.cat([p.flatten() for p in hooked["params"]])
        gathered = [torch.empty_like(flat) for _ in range(info.world_size)]
        dist.all_gather(gathered, flat)
        spread = max(float((g - flat).abs().max()) for g in gathered)
        result["runs"][str(accum)] = {
            "calls": hooked["calls"],
            "max_param_diff_vs_default_hook": diff,
            "max_param_diff_across_ranks": spread,
        }
    dist.barrier()
    dist.destroy_process_group()
    if info.is_main:
        print(MARKER + json.dumps(result), flush=True)
    # Everything is checked and printed. Leave without running interpreter-exit destructors:
    # with a Python comm hook under gloo they can still race gloo's threads and abort
    # ("terminate called without an active exception"), seen about once in 20 loaded runs.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
