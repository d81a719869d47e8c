"""The `sharded` checkpoint layout: model and optimizer state through
`torch.distributed.checkpoint` (DCP).

Every rank writes only the shards it owns (FSDP) or its share of the replicated tensors (DDP:
DCP writes each replicated tensor once), and loading reshards: a checkpoint saved on N ranks
loads on M ranks, under either strategy or in one plain process.

DCP stores its `.metadata` (and the non-tensor values, e.g. optimizer hyper-parameters) as
pickles, and its stock reader unpickles them with no restriction: a crafted checkpoint could
run code on load. `SafeReader` unpickles `.metadata` with an allow-list of DCP's own metadata
classes, and `SafeLoadPlanner` reads the values with `torch.load(weights_only=True)`; this
module registers that check with `verify` (`engine.checkpoint.manifest.register_layout`).
Writing goes through `CheckpointWriter(write_shards=write_sharded_checkpoint)`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import pathlib
import pickle
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.tensor import DTensor

from engine.checkpoint.manifest import (
    METADATA,
    SHARDS,
    CheckpointError,
    UnsafeCheckpoint,
    file_entry,
    register_layout,
)
from engine.checkpoint.trainable import check_trainable_keys, without_frozen
from engine.checkpoint.writer import commit, describe_write_error, fsync_dir, stage, tmp_dir
from engine.distributed import DistInfo, gather_object

# One process with no process group is a supported case here, not a mistake to warn about.
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized"
)

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


# Classes whose instances the metadata may fill in (pickle's BUILD). BUILD on anything else,
# a class object above all, would set attributes process-wide (e.g. redefine `PosixPath`).
_BUILDABLE = (
    dcp_metadata.Metadata,
    dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta,
    dcp_metadata.TensorStorageMetadata,
    dcp_metadata.BytesStorageMetadata,
    dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.TensorProperties,
    _StorageInfo,
)


# Enum members in the metadata: Python pickles them as `Enum(value)` (a call of the class, as
# 3.11.7 and later do) or as `getattr(Enum, "NAME")` (Debian's 3.11.2 among others); both
# are read, `getattr` only for these classes and their members' names.
_ENUMS = (dcp_metadata._MEM_FORMAT_ENCODING,)


def _enum_member(cls: Any, name: Any) -> Any:
    """What a pickled `getattr(cls, name)` may give: a member of one of DCP's own enums."""
    if cls in _ENUMS and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise UnsafeCheckpoint(
        f"the DCP metadata asks for getattr({getattr(cls, '__name__', cls)!r}, {name!r}), "
        "which is not allowed"
    )


class _MetadataUnpickler(pickle._Unpickler):  # the Python one: its opcodes can be overridden
    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"the DCP metadata refers to {module}.{name}, which is not allowed")

    def load_build(self) -> None:
        target = self.stack[-2]
        if type(target) not in _BUILDABLE:
            raise UnsafeCheckpoint(
                f"the DCP metadata sets attributes of {target!r}, which is not allowed"
            )
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def _check_structure(metadata: Any) -> None:
    """What loading relies on has the types DCP writes; anything else is refused."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpoint(f"the DCP metadata is a {type(metadata).__name__}, not Metadata")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise UnsafeCheckpoint("the DCP metadata lacks its tables of entries and storage")
    kinds = (dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata)
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, kinds):
            raise UnsafeCheckpoint(f"the DCP metadata has an entry of the wrong type: {key!r}")
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise UnsafeCheckpoint("the DCP metadata has a storage entry of the wrong type")
        name = info.relative_path
        if not isinstance(name, str) or pathlib.PurePath(name).name != name or name in ("", ".."):
            raise UnsafeCheckpoint(f"the DCP metadata points outside its directory: {name!r}")
        if not all(type(v) is int and v >= 0 for v in (info.offset, info.length)):
            raise UnsafeCheckpoint(f"the DCP metadata has a bad extent in {name!r}")
        if info.transform_descriptors:
            raise UnsafeCheckpoint(
                f"the DCP metadata asks for storage transforms {info.transform_descriptors!r}"
            )


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """Unpickle DCP's `.metadata` in `path`, allowing only DCP's own metadata classes, and
    only their instances to be filled in.

    Also checks the types loading relies on, that every shard it points to is a plain file name
    inside `path`, and that no storage transform (compression, encryption extension) is
    involved: this module writes none.
    """
    try:
        with (path / METADATA).open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpoint:
        raise
    except Exception as exc:  # a truncated or garbled pickle raises almost anything
        raise UnsafeCheckpoint(f"the DCP metadata is unreadable ({exc!r})") from None
    _check_structure(metadata)
    return metadata


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata is unpickled by `read_metadata` (an allow-list)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpoint("per-rank DCP metadata files are not supported")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """Reads stored non-tensor values with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unpickling error"
            raise UnsafeCheckpoint(
                f"the stored value {read_item.dest_index.fqn!r} is not plain data ({first})"
            ) from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


@contextlib.contextmanager
def _first_failure() -> Iterator[None]:
    """DCP reports failures as a `CheckpointException` (a BaseException) holding every failed
    rank's error; raise the lowest failed rank's own exception instead (every rank raises it;
    its `failed_rank` says whose it was)."""
    try:
        yield
    except CheckpointException as exc:
        failures = exc.failures
        if not failures:
            raise RuntimeError(str(exc)) from None
        first, _trace = failures[min(failures)]
        with contextlib.suppress(AttributeError):
            first.failed_rank = min(failures)
        raise first from None


def split_dtensors(obj: Any) -> tuple[Any, dict[str, Any]]:
    """`obj` with every DTensor replaced by None, and those DTensors keyed by their path in it
    (`"ema/shadow/3"`). For state such as a callback's: its DTensors (sharded like the
    parameters) are saved shard by shard, the rest as plain data, whose structure may change
    (None before a first value) where DCP's in-place loading would need it fixed."""
    found: dict[str, Any] = {}

    def walk(o: Any, path: tuple[str, ...]) -> Any:
        if isinstance(o, DTensor):
            found["/".join(path)] = o
            return None
        if isinstance(o, dict):
            if any("/" in str(k) for k in o):
                raise ValueError(f"state keys may not contain '/': {list(o)} at {path}")
            return {k: walk(v, (*path, str(k))) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return type(o)(walk(v, (*path, str(i))) for i, v in enumerate(o))
        return o

    return walk(obj, ()), found


def _key(container: Any, part: str) -> Any:
    """The key or index of `container` that `split_dtensors` wrote as `part`."""
    if isinstance(container, list | tuple):
        return int(part)
    for key in container:
        if str(key) == part:
            return key
    raise KeyError(part)


def get_path(obj: Any, path: str) -> Any:
    """The value at `path` (as `split_dtensors` names it) in nested dicts, lists and tuples."""
    for part in path.split("/"):
        obj = obj[_key(obj, part)]
    return obj


def with_path(obj: Any, path: str, value: Any) -> Any:
    """`obj` with `value` at `path` (the inverse of `split_dtensors`): dicts and lists are
    updated in place, tuples rebuilt."""

    def put(o: Any, parts: list[str]) -> Any:
        if not parts:
            return value
        key = _key(o, parts[0])
        new = put(o[key], parts[1:])
        if isinstance(o, tuple):
            return type(o)(new if i == key else v for i, v in enumerate(o))
        o[key] = new
        return o

    return put(obj, path.split("/"))


def saved_keys(path: Path, prefix: str) -> list[str]:
    """The keys saved under `prefix` (a top-level key of the saved state) in the DCP
    checkpoint `path`, with the prefix removed."""
    head = prefix + "."
    return [k[len(head) :] for k in read_metadata(path).state_dict_metadata if k.startswith(head)]


def _no_dist(group: dist.ProcessGroup | None) -> bool:
    return not (dist.is_available() and dist.is_initialized()) or (dist.get_world_size(group) == 1)


def save_shards(
    state: dict[str, Any], path: Path, group: dist.ProcessGroup | None = None
) -> list[str]:
    """Collective over `group`: write this rank's part of `state` into directory `path`.

    Files are fsynced. Returns the names of every file of the checkpoint (all ranks'), the
    `.metadata` included, once all of them are complete.
    """
    writer = FileSystemWriter(path, sync_files=True)
    with _first_failure():
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=_no_dist(group))
    # What dcp.save returns varies across torch versions; the written metadata does not.
    names = {info.relative_path for info in read_metadata(path).storage_data.values()}
    return sorted(names | {METADATA})


def load_shards(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group`: fill `state` (the tensors this rank holds, sharded or not) in
    place from the checkpoint in directory `path`, resharding as needed. Keys absent from
    `state` are not read; keys of `state` absent from the checkpoint are an error."""
    read_metadata(path)  # refuse an unsafe checkpoint here, before DCP falls back to others
    with _first_failure():
        dcp.load(
            state,
            storage_reader=SafeReader(path),
            planner=SafeLoadPlanner(),
            process_group=group,
            no_dist=_no_dist(group),
        )


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
    tmp = tmp_dir(root, step, session)
    # Every failure is reported through the gather below, so no rank is left waiting for it.
    staged, mine = [], {}
    if info.is_main:
        try:
            staged = [(n, file_entry(tmp / n)) for n in stage(tmp, shared, per_rank)]
        except Exception as exc:  # any failure: the other ranks must hear of it
            mine = f"rank 0: {describe_write_error(exc)}"
    try:
        names = save_shards(shards, tmp / SHARDS, group)  # returns once every rank's files exist
        share = names[info.rank :: info.world_size]
        hashed = {f"{SHARDS}/{n}": file_entry(tmp / SHARDS / n) for n in share}
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
    fsync_dir(tmp / SHARDS)
    return commit(root, tmp, step, len(per_rank), "sharded", files, keep_last)


# How the optimizer is stored. GROUPED (written now): each per-parameter tensor is its own key
# (`optimizer.state.<name>.exp_avg`, as `get_state_dict` flattens it), and each group's
# settings (lr, betas, weight decay...) are one value, with the names of the group's parameters,
# under a key made from both (`optimizer.groups.<digest>`): the ranks that hold a group (all of
# them under DDP and FSDP) make the same key, which DCP writes once; a pipeline stage holding
# other parameters makes its own. A loading rank reads every group and takes its parameters'
# settings by name, whatever split saved them.
# Read, not written: FLAT (before settings were written once), a key per parameter and setting
# (`optimizer.param_groups.<name>.lr`: on 2 FSDP ranks a LoRA run's 28 adapters x 12 AdamW
# settings were 336 values of ~1.2 KB each, DCP storing each as its own torch.save: 424 KB of
# 965 KB of shards, now one value of 3 KB in 432 KB); NESTED (before that), groups keyed by
# their index (`optimizer.param_groups.0.params`), the same keys on every rank, which DCP
# saves from one rank only: a pipeline stage would load another stage's groups.
GROUPED = "grouped"
FLAT = "flat"
NESTED = "nested"
# Only the nested layout stores a group's parameter list under its index.
_NESTED_GROUP = re.compile(r"optimizer\.param_groups\.\d+\.params")
_GROUPS = "groups."  # GROUPED's settings, under `optimizer.`
_SETTINGS = "param_groups."  # `get_state_dict`'s flattened settings, one per parameter


def _options(flatten: bool, trainable_only: bool = False) -> Any:
    """`flatten`: the optimizer's state a key per parameter (FLAT, and GROUPED's state).
    `trainable_only`: without the frozen parameters (and not strict about their absence:
    `load_sharded` checks the keys itself)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(
        flatten_optimizer_state_dict=flatten,
        ignore_frozen_params=trainable_only,
        strict=not trainable_only,
    )


def optimizer_layout(path: Path) -> str:
    """`GROUPED`, `FLAT` or `NESTED`: how the DCP checkpoint in directory `path` stores the
    optimizer."""
    keys = read_metadata(path).state_dict_metadata
    if any(k.startswith(f"optimizer.{_GROUPS}") for k in keys):
        return GROUPED
    return NESTED if any(_NESTED_GROUP.fullmatch(k) for k in keys) else FLAT


def _canonical(value: Any) -> Any:
    """`value` as plain data whose repr is exact and the same on every rank (a tensor, as a
    learning rate may be, by its dtype, shape and values; a dict by its sorted items)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.detach().cpu().tolist())
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _canonical(v)) for k, v in value.items())))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_canonical(v) for v in value))
    return value


def _split_setting(key: str, settings: set[str]) -> tuple[str, str]:
    """`<parameter name>.<setting>` (both may hold dots) at the longest known setting."""
    setting = max((s for s in settings if key.endswith(f".{s}")), key=len, default=None)
    if setting is None:
        raise ValueError(f"optimizer setting {key!r} names none of {sorted(settings)}")
    return key[: -len(setting) - 1], setting


def _settings_once(
    optimizer_state: dict[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """`get_state_dict`'s flattened optimizer state with its settings (a key per parameter
    and setting) replaced by one value per group of equal settings: `(settings, names)`,
    keyed by a digest of both. A tuple is one value to DCP (it descends into dicts and
    lists only), written by one rank."""
    known = {str(k) for group in optimizer.param_groups for k in group if k != "params"}
    out, by_name = {}, {}
    for key, value in optimizer_state.items():
        if key.startswith(_SETTINGS):
            name, setting = _split_setting(key.removeprefix(_SETTINGS), known)
            by_name.setdefault(name, {})[setting] = value
        else:
            out[key] = value
    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for name, settings in by_name.items():
        groups.setdefault(repr(_canonical(settings)), (settings, []))[1].append(name)
    for canonical, (settings, names) in groups.items():
        digest = hashlib.sha256(repr((canonical, names)).encode()).hexdigest()[:16]
        out[_GROUPS + digest] = (settings, names)
    return out


def _per_parameter_settings(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `_settings_once`: every parameter's settings as `get_state_dict`
    flattens them (`param_groups.<name>.<setting>`), from the groups read into
    `optimizer_state` (a value that is not a `(settings, names)` pair is refused)."""
    out = {}
    for key, value in optimizer_state.items():
        if not key.startswith(_GROUPS):
            continue
        if not (
            isinstance(value, tuple)
            and len(value) == 2
            and isinstance(value[0], dict)
            and isinstance(value[1], list)
            and all(isinstance(name, str) for name in value[1])
        ):
            raise UnsafeCheckpoint(f"the stored value optimizer.{key} is not a parameter group")
        settings, names = value
        for name in names:
            out.update({f"{_SETTINGS}{name}.{k}": v for k, v in settings.items()})
    return out


def sharded_model_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: str = GROUPED,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """This rank's model and optimizer state keyed by parameter name, no communication: FSDP's
    shards as DTensors, DDP's (replicated) tensors as they are, a pipeline stage's parameters
    under the whole model's names. For `CheckpointWriter` with `sharded=True`, and as the
    template `load_sharded` fills in place (`layout`: the checkpoint's, `optimizer_layout`).
    `trainable_only`: without the frozen parameters."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    try:
        options = _options(layout != NESTED, trainable_only)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    except NotImplementedError:
        # Per-parameter state DCP cannot flatten (a list, None: a user's optimizer) is saved
        # nested, as before; such a checkpoint resumes on stages only if its groups, saved
        # from one rank, name every parameter (not when a pipeline saved it).
        if layout == NESTED:
            raise
        layout = NESTED
        model_state, optimizer_state = get_state_dict(
            model, optimizer, options=_options(False, trainable_only)
        )
    if layout == GROUPED:
        optimizer_state = _settings_once(optimizer_state, optimizer)
    if trainable_only:
        model_state = without_frozen(model, model_state)
    return {"model": model_state, "optimizer": optimizer_state}


def load_sharded(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    trainable_only: bool = False,
    lay_out: Callable[[dict[str, Any]], Callable[[], None]] | None = None,
) -> None:
    """Collective: load the `sharded` checkpoint `path` into `model` (and `optimizer`, and the
    tensors of `extra` in place, e.g. callbacks' state), resharding from whatever world size,
    strategy and pipeline split saved it (each rank reads its own parameters by name).
    Every optimizer layout is read. `trainable_only`: a checkpoint of the trainable
    parameters alone, which must hold every one of them and nothing else. Unsafe or
    unreadable files raise CheckpointError; state that does not fit raises RuntimeError (or
    ValueError). `lay_out(state)`: a parallelism's own layout of some tensors of the template
    (expert parallelism's DTensors over its ranks), put back by the function it returns once
    the shards are read."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    layout, wanted = FLAT, {}
    try:
        if trainable_only:
            saved = saved_keys(path / SHARDS, "model")
            check_trainable_keys(model, saved)
        if optimizer is None:
            model_state = get_model_state_dict(model, options=_options(True, trainable_only))
            state = {"model": without_frozen(model, model_state) if trainable_only else model_state}
        else:
            layout = optimizer_layout(path / SHARDS)
            template = FLAT if layout == GROUPED else layout
            state = sharded_model_optimizer_state(model, optimizer, template, trainable_only)
            if layout == GROUPED:  # read every group; this rank's settings are taken below
                flat = state["optimizer"]
                wanted = {k: flat.pop(k) for k in list(flat) if k.startswith(_SETTINGS)}
                groups = saved_keys(path / SHARDS, "optimizer")
                flat.update({k: None for k in groups if k.startswith(_GROUPS)})
        state |= extra or {}
        put_back = lay_out(state) if lay_out is not None else None
        load_shards(state, path / SHARDS)
        if put_back is not None:
            put_back()
        if layout == GROUPED:
            state["optimizer"] = _this_ranks_settings(state["optimizer"], wanted)
    except UnsafeCheckpoint as exc:
        raise CheckpointError(
            f"refused to load {path / SHARDS}: {exc}. Nothing from it was executed."
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path / SHARDS}: {exc}") from None
    flatten = layout != NESTED
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=_options(flatten, trainable_only))
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_options(flatten, trainable_only),
        )


def _this_ranks_settings(optimizer_state: dict[str, Any], wanted: dict[str, Any]) -> dict:
    """A GROUPED optimizer state as read, turned into `get_state_dict`'s flattened one: the
    per-parameter settings `wanted` (keys of this rank's parameters) taken from the groups."""
    saved = _per_parameter_settings(optimizer_state)
    missing = [k.removeprefix(_SETTINGS) for k in wanted if k not in saved]
    if missing:
        raise RuntimeError(f"the checkpoint's optimizer has no setting {missing[0]!r}")
    out = {k: v for k, v in optimizer_state.items() if not k.startswith(_GROUPS)}
    return out | {k: saved[k] for k in wanted}


def _verify_shards(path: Path, manifest: dict[str, Any], checksums: bool, mine: Any) -> None:
    """`verify`'s check of this layout: the DCP metadata must be safe to read (once its bytes
    are known: checksummed by this process, or sizes only were asked for)."""
    if f"{SHARDS}/{METADATA}" in mine or not checksums:
        try:
            read_metadata(path / SHARDS)
        except UnsafeCheckpoint as exc:
            raise CheckpointError(
                f"{path} is unsafe: {exc}; nothing from it was executed"
            ) from None


register_layout("sharded", _verify_shards)
