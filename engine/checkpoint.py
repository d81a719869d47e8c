"""Atomic, verifiable, safe-to-load checkpoints.

Layout of one checkpoint (a directory named after its optimizer step):

    step_00000100/
        state.pt        model, optimizer, scheduler, scaler, counters, run id, config (rank 0)
        rank_00000.pt   this rank's RNG states (one file per rank)
        manifest.json   sizes and SHA-256 of every file above; written last

Rank 0 writes everything (the per-rank states are gathered to it) under a temporary name,
fsyncs it, and commits it by one `rename` of the directory, so a checkpoint is complete or
absent. Loading checks the manifest first and uses
`torch.load(weights_only=True)`: tensors and plain containers only, never arbitrary pickles.
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
from pathlib import Path
from typing import Any

import torch

from engine.distributed import DistInfo, gather_object

FORMAT = "cumulus-checkpoint/1"
MANIFEST = "manifest.json"
SHARED = "state.pt"
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step_(\d{8})$")


class CheckpointError(Exception):
    """A checkpoint that is incomplete, corrupt, foreign or unsafe."""


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


def write_checkpoint(
    root: Path,
    step: int,
    shared: dict[str, Any],
    per_rank: list[dict[str, Any]],
    session: str,
    keep_last: int | None = None,
) -> Path:
    """Rank 0: write checkpoint `step` (shared state and one file per rank) and commit it.

    Files go into a temporary directory unique to this `session` (a crashed save never mixes
    in), are fsynced, the manifest is written last, and one rename commits the directory.
    Old checkpoints beyond `keep_last` are deleted only after the new one is committed.
    """
    name = checkpoint_name(step)
    final, tmp = root / name, root / f"{TMP_PREFIX}{name}-{session}"
    tmp.mkdir(parents=True, exist_ok=True)
    _write_fsynced(tmp / SHARED, shared)
    for rank, state in enumerate(per_rank):
        _write_fsynced(tmp / rank_file(rank), state)
    files = sorted(p.name for p in tmp.iterdir())
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": len(per_rank),
        "files": {n: {"size": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in files},
    }
    with (tmp / MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
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


class CheckpointWriter:
    """Saves checkpoints inline, or with `background=True` on a writer thread.

    Every rank calls `save`: the per-rank states are gathered to rank 0 (a collective, on the
    calling thread), which alone writes the run directory. In the background mode `save`
    snapshots the state to CPU memory (the only stall) and returns; the next `save` or `wait`
    joins the previous write and re-raises its error.
    """

    def __init__(
        self,
        root: Path,
        info: DistInfo,
        session: str,
        keep_last: int | None = None,
        background: bool = False,
    ) -> None:
        self.root = root
        self.info = info
        self.session = session
        self.keep_last = keep_last
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, shared: dict[str, Any] | None, per_rank: dict[str, Any]) -> None:
        """Collective. `shared` matters on rank 0 only; `per_rank` is this rank's state."""
        self.wait()
        gathered = gather_object(per_rank, self.info)
        if not self.info.is_main:
            return
        args = (self.root, step, shared, gathered, self.session, self.keep_last)
        if not self.background:
            write_checkpoint(*args)
            return
        args = (self.root, step, cpu_copy(shared), cpu_copy(gathered), *args[4:])
        self._thread = threading.Thread(target=self._run, args=args, name="checkpoint-writer")
        self._thread.start()

    def _run(self, *args: Any) -> None:
        try:
            write_checkpoint(*args)
        except BaseException as exc:  # re-raised on the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root`, oldest first (not yet verified)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name))


def verify(path: Path) -> dict[str, Any]:
    """The manifest of `path` if every file it lists is present and intact; else raises."""
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
    for name, (size, sha256) in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{path} is corrupt: {name} has {f.stat().st_size} bytes, manifest says "
                f"{size} (truncated write?)"
            )
        if _sha256(f) != sha256:
            raise CheckpointError(f"{path} is corrupt: {name} does not match its checksum")
    return manifest


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


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    world_size: int
    shared: dict[str, Any]
    per_rank: dict[str, Any] | None  # None when saved with another world size


def load_checkpoint(path: Path, info: DistInfo) -> LoadedCheckpoint:
    """Verify and load `path` for this rank. Raises CheckpointError with the reason."""
    manifest = verify(path)
    shared = safe_load(path / SHARED)
    per_rank = None
    if manifest["world_size"] == info.world_size:
        per_rank = safe_load(path / rank_file(info.rank))
    return LoadedCheckpoint(
        path, int(manifest["step"]), int(manifest["world_size"]), shared, per_rank
    )
