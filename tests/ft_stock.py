"""One replica group trained on torchft's own stock path, for tests/test_ft.py's sensitivity
run: gradients averaged over the live groups (`Manager.allreduce`'s default AVG, what
`torchft.DistributedDataParallel`'s hook does), `torchft.Optimizer` (the update made only if
`should_commit`), the async quorum, and torchft's data rule: group g always reads its own
fixed share of each step's global batch, the data position moving on at every attempt. So a
lost group's share is dropped while it is away, and a failed step's samples are never used.
Model, task, data and schedule are the trainer's own (its assembly of the same overrides).

Not torchft's DDP wrapper itself: in torchft 0.2.0 its hook fails (`assert fut._fut`, in
`_comm_hook`) when the Manager has already errored in that step (the survivor of a lost group
crashed so at the step after the loss); the average is the same.

    python -m tests.ft_stock --group G --groups N --lighthouse ADDR --out DIR
        [--kill STEP --markers DIR] [--sleep S] -- [training overrides]

Writes DIR/stock_g<G>.jsonl ({"step", "loss"} of each committed step) and, at the end,
DIR/final_g<G>.pt (the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m tests.ft_stock")
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill", type=int, default=-1, help="SIGKILL itself in this step")
    parser.add_argument("--markers", type=Path, default=None)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    ours, _, overrides = " ".join(argv).partition(" -- ")
    return parser.parse_args(ours.split()), overrides.split()


def ready(folder: Path, group: int, groups: int, timeout_s: float = 120.0) -> None:
    """Wait until every group's Manager is up (heartbeating) before the first quorum: torchft
    has no start barrier, and a group whose imports are seconds late would otherwise find its
    peer training alone (its share of those steps dropped), a difference from the
    uninterrupted run that is start-up timing, not a loss. A group launched again finds them
    all there."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ready_g{group}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.glob("ready_g*"))) < groups and time.monotonic() < deadline:
        time.sleep(0.05)


def main(argv: list[str]) -> None:
    os.environ.setdefault("RUST_LOG", "warn")
    import torch
    import torchft
    from torchft.manager import Manager

    from engine.distributed import DistInfo
    from engine.parallel.replicas import quiet_torchft
    from trainer.api import compose
    from trainer.config.cli import to_config
    from trainer.data.loader import GlobalBatchSampler, TrainBatches
    from trainer.run.assemble import assemble
    from trainer.run.batch_plan import BatchPlan
    from trainer.run.optim import build_optimizer, build_scheduler

    args, overrides = parse(argv)
    quiet_torchft()
    cfg, _ = to_config(compose(overrides))
    parts = assemble(cfg, DistInfo())
    model, task = parts.model, parts.task
    micro, total = cfg.train.micro_batch_size, cfg.train.global_batch_size
    plan = BatchPlan(micro, total // (micro * args.groups), args.groups, total)
    sampler = GlobalBatchSampler(len(parts.data.train), total, cfg.seed)
    batches = TrainBatches(
        parts.data.train,
        sampler,
        rank=args.group,
        plan=plan,
        device=torch.device("cpu"),
        collate_fn=parts.data.collate_fn,
    )
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.train.max_steps)
    position = {"at": 0}  # the data position: every attempt moves it on

    def state_dict() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "position": position["at"],
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        from engine.parallel.replicas import cloned

        state = cloned(state)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        position["at"] = state["position"]

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=20)
    manager = Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"stock_{args.group:05d}",
        init_sync=False,
    )
    ready(args.out, args.group, args.groups)
    ft_optimizer = torchft.Optimizer(manager, optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    marker = args.markers / f"{args.kill}-forward" if args.markers is not None else None
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"stock_g{args.group}.jsonl").open("a")
    while manager.current_step() < cfg.train.max_steps:
        ft_optimizer.zero_grad()  # the (async) quorum
        step, committed = position["at"], manager.current_step()
        position["at"] += 1
        window = batches.window(step)
        if step + 1 == args.kill and marker is not None and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("killed\n")
            os.kill(os.getpid(), signal.SIGKILL)
        count = sum(int(task.count_items(b)) for b in window)
        loss = torch.zeros(())
        for batch in window:
            micro_loss = task.loss_sum(model, batch) / count  # this group's mean
            micro_loss.backward()
            loss += micro_loss.detach()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat).wait()  # AVG over the participating groups
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        if cfg.train.clip_grad_norm is not None:  # as the trainer clips
            torch.nn.utils.clip_grad_norm_(params, cfg.train.clip_grad_norm)
        time.sleep(args.sleep)
        ft_optimizer.step()  # only if should_commit
        if manager.current_step() > committed:
            scheduler.step()
            # The groups that took part: fewer is a share dropped (torchft's rule).
            line = {"step": manager.current_step(), "loss": float(loss)}
            line["participants"] = manager.num_participants()
            log.write(json.dumps(line) + "\n")
            log.flush()
    torch.save(
        {k: v.detach() for k, v in model.state_dict().items()}, args.out / f"final_g{args.group}.pt"
    )
    manager.shutdown(wait=False)
    os._exit(0)  # gloo and torchft's threads: no teardown to wait for


if __name__ == "__main__":
    main(sys.argv[1:])
