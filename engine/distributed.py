"""Process group and the few collectives the step needs.

A plain `python` launch runs without any process group; under `torchrun` the environment
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR/PORT`) decides everything.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # noqa: RUF009 (immutable)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(local_rank: int, device: str = "auto") -> torch.device:
    """`auto` takes the GPU of this local rank when CUDA is available, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_distributed(
    backend: str | None = None, device: str = "auto", timeout_s: float = 600.0
) -> DistInfo:
    """Join the process group described by the environment, if any.

    `backend=None` picks NCCL for CUDA and gloo otherwise. Under torchrun's shared agent store,
    the group is built on a store prefixed by the restart attempt: restarted workers would
    otherwise read the dead workers' gloo addresses (pytorch#135712).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(local_rank, device)
    if world_size == 1:
        return DistInfo(0, 1, 0, dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=False,
            timeout=timeout,
        )
        kwargs["store"] = dist.PrefixStore(f"attempt_{attempt}", store)
    else:
        kwargs["init_method"] = "env://"
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return DistInfo(rank, world_size, local_rank, dev)


def shutdown_distributed(clean: bool = True) -> None:
    """Leave the process group. After an error, skip the barrier: a peer may be gone."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def all_reduce_sum(
    t: torch.Tensor, info: DistInfo, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum `t` over ranks (of `group`, default all; returns a new tensor, the input is left
    alone)."""
    out = t.clone()
    if info.distributed:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_reduce_max(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    out = t.clone()
    if info.distributed:
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's `obj` on every rank (small Python values: run dir, run id)."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's `obj`, as a list on every rank; small Python values only."""
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_object(
    obj: Any, info: DistInfo, group: dist.ProcessGroup | None = None
) -> list[Any] | None:
    """Every rank's `obj` as a list on rank 0 (None elsewhere); small Python values only.
    `group`, if given, must span every rank."""
    if not info.distributed:
        return [obj]
    out: list[Any] | None = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
