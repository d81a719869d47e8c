"""Writing checkpoints: staged under a temporary name, fsynced, committed by one rename,
inline or on a background thread, with every rank agreeing on the outcome.

The `full` layout is written here (rank 0 writes `state.pt` and the per-rank files); another
layout hands `CheckpointWriter` its own write function (`engine.checkpoint.sharded`'s
`write_sharded_checkpoint`), built on `stage` and `commit` below.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.checkpoint.manifest import (
    SHARED,
    TMP_PREFIX,
    CheckpointError,
    checkpoint_name,
    file_entry,
    list_checkpoints,
    rank_file,
    write_manifest,
)
from engine.distributed import DistInfo, all_gather_object, gather_object


def _write_fsynced(path: Path, obj: Any) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_dir(root: Path, step: int, session: str) -> Path:
    """Unique to this `session`, so a crashed save never mixes into a later one."""
    return root / f"{TMP_PREFIX}{checkpoint_name(step)}-{session}"


def stage(tmp: Path, shared: dict[str, Any], per_rank: list[dict[str, Any]]) -> list[str]:
    """Rank 0: write the shared state and one file per rank into `tmp`; their names."""
    tmp.mkdir(parents=True, exist_ok=True)
    _write_fsynced(tmp / SHARED, shared)
    for rank, state in enumerate(per_rank):
        _write_fsynced(tmp / rank_file(rank), state)
    return [SHARED] + [rank_file(r) for r in range(len(per_rank))]


def write_checkpoint(
    root: Path,
    step: int,
    shared: dict[str, Any],
    per_rank: list[dict[str, Any]],
    session: str,
    keep_last: int | None = None,
) -> Path:
    """Rank 0: write checkpoint `step` in the `full` layout (shared state and one file per
    rank) and commit it."""
    tmp = tmp_dir(root, step, session)
    files = {n: file_entry(tmp / n) for n in stage(tmp, shared, per_rank)}
    return commit(root, tmp, step, len(per_rank), "full", files, keep_last)


def commit(
    root: Path,
    tmp: Path,
    step: int,
    world_size: int,
    layout: str,
    files: dict[str, dict[str, Any]],
    keep_last: int | None,
) -> Path:
    """Rank 0: write the manifest last and commit `tmp` by one rename. Old checkpoints beyond
    `keep_last` are deleted only after the new one is committed."""
    write_manifest(tmp, step, world_size, layout, files)
    fsync_dir(tmp)
    final = root / checkpoint_name(step)
    old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
    if final.exists():  # the same step saved again: move the old one aside, never delete first
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    if keep_last is not None:
        for stale in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def remove_stale_tmp(root: Path) -> None:
    """Rank 0 at startup: temporary directories of saves that never committed."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def cpu_copy(obj: Any) -> Any:
    """A snapshot of `obj` whose tensors live on the CPU and share nothing with training."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def describe_write_error(exc: BaseException) -> str:
    """The OS error at the root of a failed write (`torch.save` wraps it in a RuntimeError),
    else the exception's first line."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            where = f": {e.filename}" if e.filename else ""
            return f"[Errno {e.errno}] {e.strerror}{where}"
        e = e.__cause__ or e.__context__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


class CheckpointWriteError(Exception):
    """Checkpoint `step` could not be written. Every rank raises the same one; the temporary
    directory is gone and `committed` (the newest committed checkpoint, or None) is intact."""

    def __init__(self, step: int, tmp: Path, reasons: list[str], committed: Path | None):
        self.step, self.tmp, self.reasons, self.committed = step, tmp, reasons, committed
        super().__init__(
            f"checkpoint {tmp.parent / checkpoint_name(step)} could not be written "
            f"({'; '.join(reasons)}); its partial files ({tmp.name}) were removed"
        )


class CheckpointWriter:
    """Saves checkpoints inline, or with `background=True` on a writer thread.

    Every rank calls `save`. The per-rank states are gathered to rank 0 (a collective, on the
    calling thread). Without `write_shards` rank 0 alone writes the run directory (the `full`
    layout); with a layout's `write_shards` every rank writes its own shards of the model and
    optimizer through it. In the
    background mode `save` snapshots the state to CPU memory (the only stall) and returns;
    the next `save` or `settle` joins the previous write. Background sharded writes talk over
    a process group of their own, so they never interleave with training's collectives.

    A write that fails on any rank fails on all: the ranks agree on the outcome (a small
    collective on the training thread, once per checkpoint), rank 0 removes the temporary
    directory, and every rank raises the same `CheckpointWriteError`.
    """

    def __init__(
        self,
        root: Path,
        info: DistInfo,
        session: str,
        keep_last: int | None = None,
        background: bool = False,
        write_shards: Callable[..., Path | None] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.root = root
        self.info = info
        self.session = session
        self.keep_last = keep_last
        self.background = background
        # A sharded layout's collective write (`sharded_checkpoint.write_sharded_checkpoint`);
        # None: the `full` layout, written by rank 0 here.
        self.write_shards = write_shards
        self.sharded = write_shards is not None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: int | None = None  # the step of a background write not yet settled
        self._group: dist.ProcessGroup | None = None
        self.timeout_s = timeout_s  # of the background writer's collectives
        self.committed: Path | None = None  # the newest checkpoint known committed

    @property
    def committed_step(self) -> int | None:
        return None if self.committed is None else int(self.committed.name.split("_")[-1])

    def save(
        self,
        step: int,
        shared: dict[str, Any] | None,
        per_rank: dict[str, Any],
        shards: dict[str, Any] | None = None,
    ) -> None:
        """Collective. `shared` matters on rank 0 only; `per_rank` is this rank's state;
        `shards` (required when `sharded`) this rank's sharded model and optimizer state.
        Raises `CheckpointWriteError` (on every rank) for this write when inline, or for the
        previous background write."""
        self.settle()
        if self.sharded != (shards is not None):
            raise ValueError("pass shards exactly when the writer is sharded")
        gathered = gather_object(per_rank, self.info)
        if self.sharded:
            target: Any = self.write_shards
            if self.background and self.info.distributed and self._group is None:
                timeout = None if self.timeout_s is None else timedelta(seconds=self.timeout_s)
                self._group = dist.new_group(backend="gloo", timeout=timeout)  # all ranks here
            group = self._group if self.background else None
            args: tuple[Any, ...] = (
                self.root, step, shared, gathered, shards, self.session, self.info, group,
                self.keep_last,
            )  # fmt: skip
        else:
            target = write_checkpoint if self.info.is_main else None
            args = (self.root, step, shared, gathered, self.session, self.keep_last)
        if self.background:
            self._pending = step
            if target is not None:
                self._start(target, cpu_copy(args))
            return
        error = None
        if target is not None:
            try:
                target(*args)
            except Exception as exc:  # every rank must hear of it: agreed on below
                error = exc
        self._agree(step, error)

    def _start(self, target: Any, args: tuple[Any, ...]) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(target, *args), name="checkpoint-writer"
        )
        self._thread.start()

    def _run(self, target: Any, *args: Any) -> None:
        try:
            target(*args)
        except BaseException as exc:  # agreed on by settle() on the training thread
            self._error = exc

    @property
    def in_flight(self) -> bool:
        """A background write has started and is not settled yet (the same on every rank)."""
        return self._pending is not None

    def wait(self) -> BaseException | None:
        """Local, not collective: join this rank's background write; its error, if any. For
        paths where the other ranks may not be here (a failure elsewhere)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error

    def settle(self) -> None:
        """Collective: finish the background write in flight, if any, and agree on whether it
        committed; raises `CheckpointWriteError` on every rank if it did not."""
        error = self.wait()
        if self._pending is not None:
            step, self._pending = self._pending, None
            self._agree(step, error)

    def _agree(self, step: int, error: BaseException | None) -> None:
        mine = None
        if error is not None:
            mine = str(error) if isinstance(error, CheckpointError) else describe_write_error(error)
            mine = mine if mine.startswith("rank ") else f"rank {self.info.rank}: {mine}"
        reasons = [r for r in all_gather_object(mine, self.info) if r is not None]
        tmp = tmp_dir(self.root, step, self.session)
        if not reasons:
            self.committed = self.root / checkpoint_name(step)
            return
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(step, tmp, list(dict.fromkeys(reasons)), self.committed)
