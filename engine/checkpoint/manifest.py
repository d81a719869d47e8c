"""What a checkpoint is on disk and how it is checked: names, the manifest, verification,
safe loading.

A committed checkpoint is a directory `step_NNNNNNNN/` whose `manifest.json` (written last)
lists the size and SHA-256 of every file; `verify` checks them, then asks the checkpoint's
layout to check what only it knows (the DCP layout: its pickled `.metadata` is safe to read).
Layouts register that check themselves (`register_layout`), so this module imports none of
them: the writer (`engine.checkpoint.writer`) builds on it, the DCP layout
(`engine.checkpoint.sharded`) on both. Nothing is unpickled beyond tensors and plain
containers.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pickle
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from engine.distributed import DistInfo, all_gather_object

FORMAT = "cumulus-checkpoint/1"
MANIFEST = "manifest.json"
SHARED = "state.pt"
SHARDS = "shards"
METADATA = ".metadata"  # DCP's pickled index of a sharded checkpoint's shards
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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """What the manifest records of one file."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def write_manifest(
    tmp: Path, step: int, world_size: int, layout: str, files: dict[str, dict[str, Any]]
) -> None:
    """Write (and fsync) the manifest of the checkpoint staged in `tmp`: its format, step,
    world size, layout, and the size and SHA-256 of every file."""
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


# What a layout checks beyond sizes and checksums: (path, manifest, checksums, the files this
# process hashed). The `full` layout needs nothing more.
LayoutCheck = Callable[[Path, dict[str, Any], bool, Collection[str]], None]


@dataclass(frozen=True)
class Layout:
    check: LayoutCheck


def _no_check(path: Path, manifest: dict[str, Any], checksums: bool, mine: Collection[str]) -> None:
    return None


# Every layout a manifest may name, and the module that registers its check when imported
# (imported on first need: DCP is slow to import and most runs never read a sharded layout).
LAYOUT_MODULES = {"full": None, "sharded": "engine.checkpoint.sharded"}
_LAYOUTS: dict[str, Layout] = {"full": Layout(_no_check)}


def register_layout(name: str, check: LayoutCheck) -> None:
    """Called by a layout's module on import: `verify` runs `check` on its checkpoints."""
    _LAYOUTS[name] = Layout(check)


def _ensure_registered(layout: str) -> None:
    module = LAYOUT_MODULES[layout]
    if layout not in _LAYOUTS and module is not None:
        importlib.import_module(module)
    if layout not in _LAYOUTS:  # fail closed: never skip a layout's own safety check
        raise CheckpointError(f"the {layout!r} checkpoint layout registered no verification")


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
    if layout not in LAYOUT_MODULES:
        raise CheckpointError(
            f"{path} has a malformed manifest (layout {layout!r}; valid: "
            f"{', '.join(LAYOUT_MODULES)})"
        )
    _ensure_registered(layout)
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
        if checksums and name in mine and file_sha256(f) != sha256:
            raise CheckpointError(f"{path} is corrupt: {name} does not match its checksum")
    _LAYOUTS[layout].check(path, manifest, checksums, mine)
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
