"""One place that knows what a run saves and how a run continues from a checkpoint.

`RunState` holds everything a checkpoint holds: the model and optimizer (through the
parallelism's state I/O: gathered from stages and shards, or as DCP shards), the config (with
the keys it derives and this user's signature of both: trainer/config/signing.py), each
rank's random streams, and named stateful components (progress, scheduler, precision,
callbacks, meter, and any user component with `state_dict`/`load_state_dict`). A
checkpoint's `state.pt` holds each component's state under its name, next to the config and,
in the `full` layout, the model and optimizer. In the `sharded` layout the model and optimizer
go through DCP shards, and so do the DTensor leaves of any component's state (an EMA sharded
like the parameters): each is saved shard by shard under `state/<path>` and loaded in place
into the tensor the live component holds at the same path. Adding a component means
registering it once; saving and restoring follow.

`find_resume` picks the checkpoint a run continues from; `resume` puts the run exactly where
it left off (and says what changed).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from engine.checkpoint import (
    MANIFEST,
    SHARDS,
    CheckpointError,
    CheckpointWriter,
    LoadedCheckpoint,
    list_checkpoints,
    load_checkpoint,
    remove_stale_tmp,
    verify_together,
)
from engine.distributed import DistInfo, broadcast_object
from engine.parallel.base import Parallelism
from engine.rng import rng_state, seed_everything, set_rng_state
from engine.step import StepContext
from trainer.config.errors import UserError
from trainer.config.schema import CheckpointCfg, Config
from trainer.config.signing import sign
from trainer.run.identity import new_run_id
from trainer.run.parts import Assembly
from trainer.tracking.plurals import counted

# Beside the config: the keys it derives from others (trainer/config/trust.py:derived_keys)
# and this user's signature of both (trainer/config/signing.py).
DERIVED, SIGNATURE = "config_derived", "config_signature"
RESERVED = ("config", DERIVED, SIGNATURE, "model", "optimizer")
ADAPTER = "adapter"  # the component of adapter=lora: checked first on load
SHARDED_STATE = "state"  # the prefix of components' DTensor leaves in DCP shards


def signed_config(config: Any, derived: dict[str, str]) -> dict[str, Any]:
    """What a checkpoint's signature covers: all that evaluation and export read back of its
    config."""
    return {"config": config, "derived": derived}


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainingProgress:
    """Where a run stands, as a stateful component: steps done, the run id, and what the data
    order and the LR schedule depend on (global batch size, train.max_steps)."""

    def __init__(self, ctx: StepContext, global_batch_size: int, max_steps: int) -> None:
        self.ctx = ctx
        self.run_id = ""
        self.global_batch_size = global_batch_size
        self.max_steps = max_steps
        self.saved: dict[str, Any] = {}  # as loaded from a checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.ctx.step,
            "run_id": self.run_id,
            "global_batch_size": self.global_batch_size,
            "max_steps": self.max_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saved = {
            "step": int(state["step"]),
            "run_id": str(state["run_id"]),
            "global_batch_size": int(state["global_batch_size"]),
            "max_steps": state.get("max_steps"),
        }
        self.ctx.step = self.saved["step"]


class RunState:
    """Everything a checkpoint of a run holds. `optimizer` None: the model and components
    only (evaluation, export). With `adapter` (adapter=lora) the model's state is its
    trainable parameters alone, and the component `adapter` (the base's fingerprint) is
    checked before any of it is loaded."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        parallel: Parallelism,
        *,
        config: dict[str, Any] | None = None,
        derived: dict[str, str] | None = None,
        signature: str | None = None,
        sharded: bool = False,
        adapter: Stateful | None = None,
    ) -> None:
        self.model, self.optimizer, self.parallel = model, optimizer, parallel
        self.config, self.sharded = config, sharded
        # Saved beside the config: written by rank 0, whose signature is the one that counts.
        self.saved_config = {"config": config, DERIVED: derived or {}, SIGNATURE: signature}
        self.components: dict[str, Stateful] = {}
        self.trainable_only = adapter is not None
        if adapter is not None:
            self.add(ADAPTER, adapter)

    def add(self, name: str, component: Any) -> None:
        """Register `component` under `name`; a component without state (no `state_dict` and
        `load_state_dict`, or None) is skipped."""
        # Optional for user components (task, datasets, step strategy): the Stateful protocol.
        if component is None or not isinstance(component, Stateful):
            return
        if name in RESERVED or "/" in name or name in self.components:
            raise ValueError(f"component name {name!r} is reserved or taken")
        self.components[name] = component

    def component_states(self) -> dict[str, Any]:
        return {name: c.state_dict() for name, c in self.components.items()}

    # ---- saving ----
    def payload(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
        """What a checkpoint writes (collective: every rank calls it): the plain part for
        `state.pt` (meaningful on rank 0), this rank's part (its random streams), and in the
        sharded layout this rank's DCP shards. In the full layout the model and optimizer are
        gathered to rank 0 by the parallelism."""
        assert self.optimizer is not None, "a RunState without optimizer is for loading only"
        state = self.component_states()
        per_rank = {"rng": rng_state()}
        only = self.trainable_only
        if not self.sharded:
            model_state, optimizer_state = self.parallel.full_state(
                self.model, self.optimizer, trainable_only=only
            )
            shared = {**self.saved_config, **state, "model": model_state}
            return {**shared, "optimizer": optimizer_state}, per_rank, None
        from engine.checkpoint.sharded import split_dtensors

        shards = self.parallel.sharded_state(self.model, self.optimizer, trainable_only=only)
        state, shards[SHARDED_STATE] = split_dtensors(state)
        return {**self.saved_config, **state}, per_rank, shards

    # ---- loading ----
    def load(self, ckpt: LoadedCheckpoint) -> None:
        """Collective: the model (and optimizer, if any) and every registered component from
        `ckpt`, resharded to this run's ranks and layout. Random streams: `load_rng`."""
        saved = {k: v for k, v in ckpt.shared.items() if k not in RESERVED}
        only = self.trainable_only
        if only:  # adapters: on the base they were trained on, or nothing is loaded
            if ADAPTER not in saved:
                raise ValueError(
                    "it holds the whole model, not adapters (it was saved without adapter=lora)"
                )
            self.components[ADAPTER].load_state_dict(saved[ADAPTER])
        elif ckpt.shared.get(ADAPTER) is not None:
            raise ValueError("it holds adapters only (saved with adapter=lora), not a whole model")
        if ckpt.layout == "sharded":
            from engine.checkpoint.sharded import with_path

            targets = self._sharded_targets(ckpt)
            self.parallel.load_sharded_state(
                ckpt.path, self.model, self.optimizer, {SHARDED_STATE: targets}, only
            )
            for key, tensor in targets.items():
                saved = with_path(saved, key, tensor)
        else:
            optimizer_state = ckpt.shared["optimizer"] if self.optimizer is not None else None
            self.parallel.load_full_state(
                self.model, self.optimizer, ckpt.shared["model"], optimizer_state, only
            )
        self.load_components(saved)

    def load_components(self, state: dict[str, Any]) -> None:
        """Each component's own state; a component whose state the checkpoint lacks is an
        error unless it has none to restore (e.g. a stateless callback list)."""
        for name, component in self.components.items():
            if name == ADAPTER:
                continue  # checked before the model was loaded
            if name not in state:
                if _empty(component.state_dict()):
                    continue
                raise KeyError(f"the checkpoint holds no state for {name!r}")
            component.load_state_dict(state[name])

    def _sharded_targets(self, ckpt: LoadedCheckpoint) -> dict[str, torch.Tensor]:
        """Where to load the component tensors the checkpoint saved shard by shard: the live
        components' own tensors at the same paths (sharded or not: loading reshards). State of
        a component, or of a callback, that this run does not have is left unread."""
        from engine.checkpoint.sharded import get_path, saved_keys

        live = self.component_states()
        out = {}
        for key in saved_keys(ckpt.path / SHARDS, SHARDED_STATE):
            parts = key.split("/")
            try:  # a named entry this run lacks (a callback dropped on resume): skip
                get_path(live, "/".join(parts[:2]))
            except (KeyError, IndexError, TypeError):
                continue
            try:
                value = get_path(live, key)
            except (KeyError, IndexError, TypeError):
                value = None
            if not isinstance(value, torch.Tensor):
                raise KeyError(f"state {key} is in the checkpoint but not in this run")
            out[key] = value
        return out


def _empty(state: Any) -> bool:
    if isinstance(state, dict):
        return all(_empty(v) for v in state.values())
    return state is None


def build_checkpointer(
    cfg: CheckpointCfg,
    checkpoint_dir: Path,
    info: DistInfo,
    sharded: bool,
    timeout_s: float,
    shared_dir: bool = False,
) -> CheckpointWriter:
    """`shared_dir`: other launches write here too (ft's replica groups), so this one does not
    remove what looks like a crashed save at its start: it may be theirs, live."""
    if info.is_main and not shared_dir:
        remove_stale_tmp(checkpoint_dir)
    write_shards = None
    if sharded:
        from engine.checkpoint.sharded import write_sharded_checkpoint as write_shards
    return CheckpointWriter(
        checkpoint_dir,
        info,
        session=broadcast_object(new_run_id(), info),
        keep_last=cfg.keep_last,
        background=cfg.async_save,
        write_shards=write_shards,
        timeout_s=timeout_s,
    )


def find_resume(resume: str, ckpt_dir: Path, info: DistInfo) -> Path | None:
    """The checkpoint to resume from, the same on every rank: the newest that verifies
    (`auto`: of this run; a run directory or its `checkpoints/`: of that run) or the given
    checkpoint. All ranks verify each candidate together."""
    if resume == "never":
        return None
    error, newest = None, resume == "auto"
    if resume == "auto":
        candidates = list(reversed(list_checkpoints(ckpt_dir))) if info.is_main else []
    else:
        given = Path(resume).expanduser()
        candidates = [given]
        if info.is_main and not given.exists():
            error = (
                f"checkpoint.resume: {given} does not exist; valid: auto, never, the path of a "
                "checkpoint directory (run_dir/checkpoints/step_NNNNNNNN) or a run directory "
                "(its newest valid checkpoint)"
            )
        elif info.is_main and given.is_dir() and not (given / MANIFEST).exists():
            root = given / "checkpoints" if (given / "checkpoints").is_dir() else given
            candidates, newest = list(reversed(list_checkpoints(root))), True
            if not candidates:
                error = (
                    f"checkpoint.resume: {given} is neither a checkpoint nor a run directory "
                    f"with checkpoints under {root}; pass a checkpoint directory "
                    "(run_dir/checkpoints/step_NNNNNNNN) or a run directory that has one"
                )
    candidates, newest, error = broadcast_object((candidates, newest, error), info)
    if error:
        raise UserError(error, all_ranks=True)
    for path in candidates:
        problem = verify_together(path, info)
        if problem is None:
            return path
        if not newest:
            raise UserError(f"checkpoint.resume: {problem}", all_ranks=True)
        if info.is_main:
            print(f"WARNING: skipping checkpoint: {problem}", file=sys.stderr)
    if resume != "auto" and candidates:
        raise UserError(
            f"checkpoint.resume: no checkpoint under {resume} verifies (see the warnings above)",
            all_ranks=True,
        )
    return None


def summarize(exc: BaseException) -> str:
    """The first line of a long load_state_dict error, with how many more it had."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    detail = [ln for ln in lines[1:] if not ln.endswith(":")]
    more = f" (and {len(detail) - 1} more)" if len(detail) > 1 else ""
    return f"{lines[0].rstrip(':.')}{': ' + detail[0] if detail else ''}{more}"


def load_state(
    state: RunState, path: Path, info: DistInfo, key: str, misfit: str
) -> LoadedCheckpoint:
    """Collective: load checkpoint `path` (verified already) into `state`. Anything unsafe or
    unreadable is one paragraph naming `key`; state that does not fit says `misfit` (what
    does not fit and how to put it right) after the first line of the error."""
    try:
        ckpt = load_checkpoint(path, info, checksums=False)
        state.load(ckpt)
    except CheckpointError as exc:  # unsafe or unreadable: every rank got the same
        raise UserError(f"{key}: {exc}", all_ranks=True) from None
    except (KeyError, RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise UserError(misfit.format(path=path, error=summarize(exc)), all_ranks=True) from None
    return ckpt


@dataclass(frozen=True)
class Resumed:
    """Where a run continues from: its checkpoint and step (None and 0: a fresh start)."""

    path: Path | None
    step: int
    run_id: str
    evaluated: bool  # its last record holds an evaluation of `step` (a finished run)


@dataclass(frozen=True)
class ResumeSettings:
    """What `resume` needs besides the state: plain values from the config."""

    resume: str  # checkpoint.resume
    seed: int
    max_steps: int
    global_batch_size: int
    schedule_uses_max_steps: bool


def resume(
    state: RunState,
    progress: TrainingProgress,
    run_dir: Path,
    settings: ResumeSettings,
    info: DistInfo,
) -> Resumed:
    """Put the run exactly where its checkpoint left it (the newest valid one of `run_dir`,
    or `checkpoint.resume`), or start fresh; decide the run id (the same W&B run only when
    continuing this run directory; a branch elsewhere gets its own); seed each rank's streams.
    Random streams last: nothing after this may consume randomness before the first step."""
    ckpt_dir = run_dir / "checkpoints"
    path = find_resume(settings.resume, ckpt_dir, info)
    if path is None:
        # Each data-parallel rank its own dropout stream, independent of the initialization
        # stream (ranks that compute the same activations share one: the parallelism says).
        seed_everything(settings.seed + 1 + state.parallel.dropout_stream)
        # Kept in checkpoints: a resume of this run directory continues the trackers' run.
        progress.run_id = broadcast_object(new_run_id(), info)
        return Resumed(None, 0, progress.run_id, False)
    ckpt = load_state(
        state,
        path,
        info,
        "checkpoint.resume",
        "checkpoint {path} does not fit this run: {error}. Resume with the model, optimizer, "
        "callbacks and other components it was saved with, or pass checkpoint.resume=never.",
    )
    saved = progress.saved
    same_dir = path.resolve().parent == ckpt_dir.resolve()
    run_id = saved["run_id"] if same_dir and saved["run_id"] else new_run_id()
    progress.run_id = broadcast_object(run_id, info)
    if info.is_main:
        warn_changes(path, saved, settings)
    rng = None if ckpt.per_rank is None else ckpt.per_rank["rng"]
    if rng is not None:
        if "cuda" in rng and not torch.cuda.is_available() and info.is_main:
            print(f"WARNING: {path} holds CUDA RNG state; this run has no CUDA", file=sys.stderr)
        set_rng_state(rng)
    else:
        if info.is_main:
            print(
                f"WARNING: {path} was saved by {counted(ckpt.world_size, 'rank')}, this run has "
                f"{info.world_size}: model and optimizer resume exactly, random streams "
                "(dropout) are reseeded",
                file=sys.stderr,
            )
        seed_everything(settings.seed + 1_000_003 * ckpt.step + state.parallel.dp_rank)
    evaluated = same_dir and info.is_main and evaluated_at(run_dir, ckpt.step)
    evaluated = broadcast_object(evaluated, info)
    return Resumed(path, ckpt.step, progress.run_id, evaluated)


def warn_changes(path: Path, saved: dict[str, Any], settings: ResumeSettings) -> None:
    """What differs from the run the checkpoint comes from: the data order, the schedule."""
    if saved["global_batch_size"] != settings.global_batch_size:
        print(
            f"WARNING: {path} was trained with global batch {saved['global_batch_size']}, "
            f"this run uses {settings.global_batch_size}: the data order from here on differs",
            file=sys.stderr,
        )
    horizon = saved["max_steps"]
    if horizon not in (None, settings.max_steps) and settings.schedule_uses_max_steps:
        print(
            f"WARNING: the LR schedule decays over train.max_steps; it was {horizon} when "
            f"{path} was saved and is {settings.max_steps} now, so the learning rate from "
            "here on follows the new schedule",
            file=sys.stderr,
        )


def evaluated_at(run_dir: Path, step: int) -> bool:
    """Whether `metrics.jsonl` already holds a validation record of `step` (rank 0 reads)."""
    import json

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return False
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("step") == step and any(k.startswith("val/") for k in record):
            return True
    return False


def build_state(
    cfg: Config,
    config: dict[str, Any],
    ctx: StepContext,
    parts: Assembly,
    derived: dict[str, str] | None = None,
    **named: Any,
) -> RunState:
    """What a checkpoint holds: the model and optimizer through the parallelism, the config
    (with the keys it derives, `derived`, signed on rank 0 with this user's secret), and the
    named stateful components (user components join when they have state)."""
    fmt = cfg.checkpoint.format
    sharded = (fmt if fmt != "auto" else parts.parallel.checkpoint_format) == "sharded"
    derived = derived or {}
    signature = sign(signed_config(config, derived)) if ctx.dist.is_main else None
    state = RunState(
        parts.model,
        ctx.optimizer,
        parts.parallel,
        config=config,
        derived=derived,
        signature=signature,
        sharded=sharded,
        adapter=parts.adapter,
    )
    for name, component in {
        **named,
        "scheduler": ctx.scheduler,
        "precision": ctx.precision,
        "callbacks": ctx.callbacks,
        "task": parts.task,
        "train_data": parts.data.train,
        "val_data": parts.data.val,
    }.items():
        state.add(name, component)
    return state
