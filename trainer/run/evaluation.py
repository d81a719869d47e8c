"""A checkpoint evaluated as training evaluates: its saved config (untrusted input,
trainer/config/trust.py) composed with the overrides, the run rebuilt, the validation split
run. The command: `python -m trainer.evaluate` (trainer/evaluate.py)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.callbacks import AveragedWeights, CallbackList
from engine.checkpoint import (
    MANIFEST,
    SHARED,
    latest_valid,
    safe_load,
    verify,
)
from engine.distributed import DistInfo, unwrap
from engine.evaluate import evaluate
from engine.numerics.precision import Precision
from engine.parallel.dims import ParallelDims
from engine.window_task import WindowTask
from trainer.config.components import current_targets
from trainer.config.errors import UserError
from trainer.config.pretrained import drop_saved_architecture
from trainer.config.schema import Config
from trainer.config.signing import is_own
from trainer.config.trust import (
    BUILT_FROM_SAVED,
    check_derived,
    check_paths,
    check_saved,
    check_targets,
)
from trainer.data.batches import build_val_batches
from trainer.run.assemble import CONFIG_DIR, assemble
from trainer.run.build import instantiate_callback
from trainer.run.fit import val_metrics
from trainer.run.state import DERIVED, SIGNATURE, RunState, load_state, signed_config
from trainer.tracking.records import EvalProgress


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def compose_config(
    saved: dict[str, Any], overrides: list[str], derived: dict[str, str] | None = None
) -> tuple[DictConfig, DictConfig]:
    """The checkpoint's config with `overrides` applied as training applies them: the
    overrides are composed by Hydra (from this repository's configs and any
    `hydra.searchpath`), then a group selection (`data=NAME`) replaces that whole node of the
    saved config and a key (`eval.max_batches=...`) that one value. The keys the run derived
    from others (`derived`: `data.pretrained: ${oc.select:model.pretrained,null}`) are
    derived again, so they follow what the user gives now (`model.pretrained=NEW_DIR`). Also
    returns that fresh composition: what this version's configs give without the file."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        fresh = compose("train", overrides=overrides)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), saved)
    for key, reference in (derived or {}).items():
        rederive(cfg, key, reference)
    for override in overrides:
        key = _key(override)
        if key.startswith("hydra.") or key == "hydra":
            continue
        if override.lstrip("+").startswith("~"):
            OmegaConf.update(cfg, key, None, force_add=True)  # deleted: back to no value
            continue
        OmegaConf.update(cfg, key, OmegaConf.select(fresh, key), merge=False, force_add=True)
    return cfg, fresh


def rederive(cfg: DictConfig, key: str, reference: str) -> None:
    """Put `reference` (an interpolation) back at `key`, which holds its value as saved; a
    key the schema no longer has, or a reference that no longer resolves, keeps that value."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    if not isinstance(node, DictConfig) or leaf not in node:
        return
    value = node[leaf]
    try:
        node[leaf] = reference
        node[leaf]  # resolves it, or raises
    except OmegaConfBaseException:
        node[leaf] = value


def resolve_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint; for a run directory (or its `checkpoints/`),
    its newest checkpoint that verifies."""
    if not path.exists():
        raise UserError(
            f"checkpoint: {path} does not exist; expected a checkpoint directory such as "
            "RUN_DIR/checkpoints/step_NNNNNNNN, or a run directory"
        )
    if (path / MANIFEST).exists() or not path.is_dir():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    newest, skipped = latest_valid(root)
    if newest is None:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise UserError(
            f"checkpoint: {path} is neither a checkpoint nor a run directory with a valid "
            f"checkpoint under {root}{why}; pass a checkpoint directory "
            "(RUN_DIR/checkpoints/step_NNNNNNNN) or a run directory that has one"
        )
    for warning in skipped:
        print(f"warning: {warning}", file=sys.stderr)
    return newest


def _nodes(cfg: DictConfig, names: Sequence[str]) -> dict[str, Any]:
    """The named top-level nodes of `cfg`, resolved (`data.block_size` reads `model.*`)."""
    return {n: OmegaConf.to_container(cfg[n], resolve=True) for n in names if n in cfg}


def checkpoint_config(
    path: Path,
    overrides: list[str],
    trust: Sequence[str] = (),
    command: str = "python -m trainer.evaluate",
    saved_paths: bool = False,
    uses: Sequence[str] = BUILT_FROM_SAVED,
) -> DictConfig:
    """The config checkpoint `path` was saved with, `overrides` applied. The checkpoint is
    verified first (UserError / CheckpointError when missing or damaged), and the saved config
    is untrusted input: a target it names that is neither shipped, restated by the user, nor
    under a `trust` prefix is refused before anything is imported, and a path only it sets
    is refused unless `saved_paths` (trainer/config/trust.py). A config this user's secret
    signed (trainer/config/signing.py: a run of their own, unedited) is theirs: its targets
    and paths are used. `uses`: what the command reads of the config (nodes or keys), whose
    paths are checked."""
    verify(path)
    shared = safe_load(path / SHARED)
    check_saved(shared.get("config"), path)
    derived = check_derived(shared.get(DERIVED), path)
    # Signed with this user's secret: a checkpoint of their own, its targets and paths theirs.
    own = is_own(signed_config(shared.get("config"), derived), shared.get(SIGNATURE))
    saved = current_targets(shared.get("config"))
    try:
        cfg, fresh = compose_config(saved, overrides, derived)
    except OmegaConfBaseException as exc:
        if any(_key(o) in str(exc) for o in overrides):
            raise  # the user's override, reported as one by the caller
        first = " ".join(str(exc).split("\n")[0].split())
        raise UserError(
            f"checkpoint: the config saved in {path} does not fit this version's schema "
            f"({first}); it was written by another version of cumulus or altered"
        ) from None
    drop_saved_architecture(cfg, overrides)
    if own:
        return cfg
    composed = OmegaConf.to_container(cfg, resolve=False)
    check_targets(
        composed, path, config_dir=CONFIG_DIR, overrides=overrides, trust=trust, command=command
    )
    check_paths(
        _nodes(cfg, BUILT_FROM_SAVED),
        _nodes(fresh, BUILT_FROM_SAVED),
        path,
        overrides=overrides,
        allow=saved_paths,
        uses=uses,
        command=command,
    )
    return cfg


def averaged_weights(cfg: Config, weights: str) -> AveragedWeights | None:
    """The callback whose averaged weights `weights=NAME` asks for (None for `model`)."""
    if weights == "model":
        return None
    valid = [
        name
        for name, spec in cfg.callbacks.items()
        if isinstance(instantiate_callback(name, spec), AveragedWeights)
    ]
    if weights not in valid:
        raise UserError(
            f"weights={weights}: the checkpoint's run has no weight-averaging callback of that "
            f"name; valid: model{''.join(', ' + n for n in valid)}"
        )
    return instantiate_callback(weights, cfg.callbacks[weights])  # type: ignore[return-value]


def evaluation_dims(cfg: Config, info: DistInfo) -> ParallelDims:
    """The layout to evaluate with: the run's own (`dist.*`, with the overrides) when this job
    has ranks for it; on one process the whole model, whatever the checkpoint's run used."""
    if not info.distributed:
        return ParallelDims(strategy=cfg.dist.strategy, world=1)
    return cfg.dist.dims(info.world_size)


def evaluate_checkpoint(
    path: Path, cfg: Config, info: DistInfo, weights: str = "model"
) -> dict[str, Any]:
    """The checkpoint's metrics: the model, task and data built as training builds them
    (`trainer.run.assemble`), its state loaded through the layout's state I/O."""
    parts = assemble(cfg, info, evaluation_dims(cfg, info))
    averaged = averaged_weights(cfg, weights)
    state = RunState(parts.model, None, parts.parallel, adapter=parts.adapter)
    if averaged is not None:
        averaged.attach(parts.model)
        state.add("callbacks", CallbackList({weights: averaged}))
    ckpt = load_state(  # collective under torchrun for a sharded checkpoint
        state,
        path,
        info,
        "checkpoint",
        "checkpoint: {path} does not fit the model its config builds with these overrides: "
        "{error}. Drop the model.* overrides.",
    )
    whole = isinstance(parts.task, WindowTask)
    val = build_val_batches(
        parts.data, parts.data_extras, cfg.eval, cfg.seed, info, parts.parallel, whole
    )
    precision = Precision(cfg.train.precision, info.device.type)
    model = unwrap(parts.wrapped)
    progress = None
    if info.is_main:  # on stderr: stdout's last line is the metrics' JSON
        progress = EvalProgress(len(val), f"evaluating {path.name}", marks=True, stream=sys.stderr)
    with contextlib.ExitStack() as stack:
        if averaged is not None:
            stack.enter_context(averaged.weights_swapped(model))
        means, count = evaluate(model, parts.task, val, precision, info, parts.parallel, progress)
    return {"step": ckpt.step, **val_metrics(means, count, parts.task)}
