"""Atomic, verifiable, safe-to-load checkpoints.

Layout of one checkpoint (a directory named after its optimizer step):

    step_00000100/
        state.pt        scheduler, scaler, counters, run id, config, and in the `full` layout
                        the whole model and optimizer state
        rank_00000.pt   each rank's RNG states (one file per rank)
        shards/         `sharded` layout only: model and optimizer state as DCP files, each
                        rank's own shards (`engine.sharded_checkpoint`)
        manifest.json   layout, sizes and SHA-256 of every file above; written last

`full`: rank 0 gathers the unsharded state and writes every file. `sharded`: every rank
writes its shards in parallel (nothing is gathered; the run directory must be on a filesystem
all ranks share), hashes its share of the files, and rank 0 writes the rest. Either way the
files go under a temporary name, are fsynced, and one `rename` of the directory by rank 0
commits them, so a checkpoint is complete or absent. Loading checks the manifest first and
unpickles nothing but tensors and plain containers (`torch.load(weights_only=True)`, and an
allow-list for DCP's metadata).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed as dist

from engine.distributed import DistInfo, all_gather_object, gather_object

# engine.sharded_checkpoint (and torch.distributed.checkpoint, slow to import) is imported
# only where a sharded checkpoint is written or read.

FORMAT = "cumulus-checkpoint/1"
MANIFEST = "manifest.json"
SHARED = "state.pt"
SHARDS = "shards"
METADATA = ".metadata"  # DCP's pickled index of a sharded checkpoint's shards
LAYOUTS = ("full", "sharded")
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step_(\d{8})$")


class CheckpointError(Exception):
    """A checkpoint that is incomplete, corrupt, foreign or unsafe."""


class UnsafeCheckpoint(Exception):
    """The DCP metadata or a stored value holds something other than plain data."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _write_fsynced(path: Path, obj: Any) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tmp_dir(root: Path, step: int, session: str) -> Path:
    """Unique to this `session`, so a crashed save never mixes into a later one."""
    return root / f"{TMP_PREFIX}{checkpoint_name(step)}-{session}"


def _stage(tmp: Path, shared: dict[str, Any], per_rank: list[dict[str, Any]]) -> list[str]:
    """Rank 0: write the shared state and one file per rank into `tmp`; their names."""
    tmp.mkdir(parents=True, exist_ok=True)
    _write_fsynced(tmp / SHARED, shared)
    for rank, state in enumerate(per_rank):
        _write_fsynced(tmp / rank_file(rank), state)
    return [SHARED] + [rank_file(r) for r in range(len(per_rank))]


def _entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


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
    tmp = _tmp_dir(root, step, session)
    files = {n: _entry(tmp / n) for n in _stage(tmp, shared, per_rank)}
    return _commit(root, tmp, step, len(per_rank), "full", files, keep_last)


def write_sharded_checkpoint(
    root: Path,
    step: int,
    shared: dict[str, Any] | None,
    per_rank: list[dict[str, Any]] | None,
    shards: dict[str, Any],
    session: str,
    info: DistInfo,
    group: dist.ProcessGroup | None = None,
    keep_last: int | None = None,
) -> Path | None:
    """Collective over `group` (all ranks): write checkpoint `step` in the `sharded` layout.

    Every rank writes its own `shards` (DCP) and hashes an equal share of the files; rank 0
    also writes `shared` and `per_rank` (gathered), then commits. Returns the path on rank 0.
    """
    from engine.sharded_checkpoint import save_shards

    tmp = _tmp_dir(root, step, session)
    # Every failure is reported through the gather below, so no rank is left waiting for it.
    staged, mine = [], {}
    if info.is_main:
        try:
            staged = [(n, _entry(tmp / n)) for n in _stage(tmp, shared, per_rank)]
        except Exception as exc:  # any failure: the other ranks must hear of it
            mine = f"rank 0: {describe_write_error(exc)}"
    try:
        names = save_shards(shards, tmp / SHARDS, group)  # returns once every rank's files exist
        share = names[info.rank :: info.world_size]
        hashed = {f"{SHARDS}/{n}": _entry(tmp / SHARDS / n) for n in share}
        mine = mine or hashed
    except Exception as exc:  # a rank's write failed: DCP raises it on every rank
        mine = mine or f"rank {getattr(exc, 'failed_rank', info.rank)}: {describe_write_error(exc)}"
    parts = gather_object(mine, info, group)
    if parts is None:
        return None
    errors = [p for p in parts if isinstance(p, str)]
    if errors:
        raise CheckpointError("; ".join(dict.fromkeys(errors)))
    files = dict(staged)
    for part in parts:
        files.update(part)
    _fsync_dir(tmp / SHARDS)
    return _commit(root, tmp, step, len(per_rank), "sharded", files, keep_last)


def _commit(
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
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "layout": layout,
        "files": dict(sorted(files.items())),
    }
    with (tmp / MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = root / checkpoint_name(step)
    old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
    if final.exists():  # the same step saved again: move the old one aside, never delete first
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
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
    calling thread). With `sharded=False` rank 0 alone writes the run directory; with
    `sharded=True` every rank writes its own shards of the model and optimizer. In the
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
        sharded: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        self.root = root
        self.info = info
        self.session = session
        self.keep_last = keep_last
        self.background = background
        self.sharded = sharded
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
            target: Any = write_sharded_checkpoint
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
        tmp = _tmp_dir(self.root, step, self.session)
        if not reasons:
            self.committed = self.root / checkpoint_name(step)
            return
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(step, tmp, list(dict.fromkeys(reasons)), self.committed)


def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root`, oldest first (not yet verified)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def verify(path: Path, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """The manifest of `path` if every file it lists is present and intact; else raises.

    `checksums=False` checks presence and sizes only (for a checkpoint verified moments ago).
    `share=(i, n)` hashes only every n-th file from the i-th, for n processes verifying one
    checkpoint together (`verify_together`).
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is not a cumulus checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path} is unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a cumulus checkpoint (manifest format "
            f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
            f"expected {FORMAT!r})"
        )
    try:
        files = {str(n): (int(m["size"]), str(m["sha256"])) for n, m in manifest["files"].items()}
        int(manifest["step"]), int(manifest["world_size"])  # both must be integers
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(
            f"{path} has a malformed manifest ({exc!r} missing or wrong)"
        ) from None
    layout = manifest.setdefault("layout", "full")
    if layout not in LAYOUTS:
        raise CheckpointError(
            f"{path} has a malformed manifest (layout {layout!r}; valid: {', '.join(LAYOUTS)})"
        )
    for name in files:
        parts = PurePosixPath(name).parts
        if not parts or name.startswith("/") or ".." in parts or "\\" in name:
            raise CheckpointError(f"{path} has a malformed manifest (file name {name!r})")
    mine = set(sorted(files)[share[0] :: share[1]])
    for name, (size, sha256) in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{path} is corrupt: {name} has {f.stat().st_size} bytes, manifest says "
                f"{size} (truncated write?)"
            )
        if checksums and name in mine and _sha256(f) != sha256:
            raise CheckpointError(f"{path} is corrupt: {name} does not match its checksum")
    metadata = f"{SHARDS}/{METADATA}"
    if layout == "sharded" and (metadata in mine or not checksums):  # once its bytes are known
        from engine.sharded_checkpoint import read_metadata

        try:
            read_metadata(path / SHARDS)
        except UnsafeCheckpoint as exc:
            raise CheckpointError(
                f"{path} is unsafe: {exc}; nothing from it was executed"
            ) from None
    return manifest


def verify_together(path: Path, info: DistInfo) -> str | None:
    """Collective: every rank checks `path` and hashes its share of the files, so a large
    sharded checkpoint is read once in parallel, not all by rank 0 (which could outlast the
    other ranks' collective timeout). The first problem any rank found, or None."""
    try:
        verify(path, share=(info.rank, info.world_size))
        problem = None
    except CheckpointError as exc:
        problem = str(exc)
    return next((p for p in all_gather_object(problem, info) if p), None)


def latest_valid(root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` that verifies, and a warning for each one skipped."""
    warnings = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify(path)
            return path, warnings
        except CheckpointError as exc:
            warnings.append(f"skipping checkpoint: {exc}")
    return None, warnings


def safe_load(path: Path) -> Any:
    """`torch.load` that only accepts tensors and plain containers; anything else is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"refused to load {path}: it holds objects other than tensors and plain containers "
            f"({first}). Nothing from it was executed."
        ) from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def model_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full (unsharded) model and optimizer state keyed by parameter name, on the CPU.

    Collective under a process group: every rank calls it; rank 0 receives the state, other
    ranks empty dicts. The same format for one process, DDP and FSDP, so a checkpoint saved
    with any of them on N ranks resumes with any other on M ranks.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_model_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
) -> None:
    """Load full state from `model_optimizer_state` into a (possibly sharded) model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
        options=StateDictOptions(full_state_dict=True),
    )


def sharded_model_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """This rank's model and optimizer state keyed by parameter name, no communication: FSDP's
    shards as DTensors, DDP's (replicated) tensors as they are. For `CheckpointWriter` with
    `sharded=True`, and as the template `load_sharded` fills in place."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load_sharded(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Collective: load the `sharded` checkpoint `path` into `model` (and `optimizer`, and the
    tensors of `extra` in place, e.g. callbacks' state), resharding from whatever world size
    and strategy saved it. Unsafe or unreadable files raise CheckpointError; state that does
    not fit raises RuntimeError."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from engine.sharded_checkpoint import load_shards

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        state = sharded_model_optimizer_state(model, optimizer)
    state |= extra or {}
    try:
        load_shards(state, path / SHARDS)
    except UnsafeCheckpoint as exc:
        raise CheckpointError(
            f"refused to load {path / SHARDS}: {exc}. Nothing from it was executed."
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path / SHARDS}: {exc}") from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    world_size: int
    layout: str  # full: model and optimizer in `shared`; sharded: `load_sharded` reads them
    shared: dict[str, Any]
    per_rank: dict[str, Any] | None  # None when saved with another world size


def load_checkpoint(path: Path, info: DistInfo, checksums: bool = True) -> LoadedCheckpoint:
    """Verify and load `path` for this rank (all but the sharded model and optimizer state).
    Raises CheckpointError with the reason."""
    manifest = verify(path, checksums)
    shared = safe_load(path / SHARED)
    per_rank = None
    if manifest["world_size"] == info.world_size:
        per_rank = safe_load(path / rank_file(info.rank))
    return LoadedCheckpoint(
        path,
        int(manifest["step"]),
        int(manifest["world_size"]),
        manifest["layout"],
        shared,
        per_rank,
    )
