"""`python -m trainer.evaluate checkpoint=PATH [overrides]` (also under torchrun).

Rebuilds the run's model, task and data from the checkpoint's own config with the overrides
on top, exactly as training takes them (`eval.max_batches=null` for the whole validation
split, `data.path=...`, group selections such as `data=...` or `model=gpt_tiny`,
`hydra.searchpath=[file://DIR]` for a user's config folder), evaluates, and prints the
metrics as one JSON object on the last line of stdout. Writes nothing.
`weights=NAME` evaluates the weights an averaging callback (`ema`) kept instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from engine.callbacks import AveragedWeights, CallbackList
from engine.checkpoint import SHARED, CheckpointError, load_checkpoint, safe_load, verify
from engine.distributed import DistInfo
from engine.evaluate import evaluate
from engine.precision import Precision
from engine.rng import seed_everything
from trainer.build import (
    CONFIG_DIR,
    build_batches,
    build_data,
    build_model,
    build_task,
    check_fits,
    instantiate_callback,
)
from trainer.cli import check_overrides, run_command
from trainer.config import Config, register_configs
from trainer.errors import UserError
from trainer.fit import summarize, val_metrics
from trainer.identity import register_resolvers
from trainer.state import RunState, load_payload

USAGE = "usage: python -m trainer.evaluate checkpoint=PATH [weights=model|NAME] [key=value ...]"


def parse_args(argv: list[str]) -> tuple[Path, str, list[str]]:
    """`checkpoint=PATH`, `weights=model|NAME` (a weight-averaging callback such as `ema`),
    and the config overrides."""
    ckpt = [a.split("=", 1)[1] for a in argv if a.startswith("checkpoint=")]
    weights = [a.split("=", 1)[1] for a in argv if a.startswith("weights=")]
    rest = [a for a in argv if not a.startswith(("checkpoint=", "weights="))]
    if len(ckpt) != 1 or not ckpt[0]:
        raise UserError(f"checkpoint=PATH is required exactly once. {USAGE}")
    bad = [a for a in rest if "=" not in a]
    if bad:
        raise UserError(f"overrides must look like key=value, got {bad}. {USAGE}")
    return Path(ckpt[0]).expanduser(), (weights or ["model"])[-1], rest


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def compose_config(saved: dict[str, Any], overrides: list[str]) -> DictConfig:
    """The checkpoint's config with `overrides` applied as training applies them: the
    overrides are composed by Hydra (from this repository's configs and any
    `hydra.searchpath`), then a group selection (`data=NAME`) replaces that whole node of the
    saved config and a key (`eval.max_batches=...`) that one value."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        fresh = compose("train", overrides=overrides)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), saved)
    for override in overrides:
        key = _key(override)
        if key.startswith("hydra.") or key == "hydra":
            continue
        if override.lstrip("+").startswith("~"):
            OmegaConf.update(cfg, key, None, force_add=True)  # deleted: back to no value
            continue
        OmegaConf.update(cfg, key, OmegaConf.select(fresh, key), merge=False, force_add=True)
    return cfg


def checkpoint_config(path: Path, overrides: list[str]) -> DictConfig:
    """The config checkpoint `path` was saved with, `overrides` applied; the checkpoint is
    verified first (UserError / CheckpointError when missing or damaged)."""
    if not path.exists():
        raise UserError(
            f"checkpoint: {path} does not exist; expected a checkpoint directory such as "
            "RUN_DIR/checkpoints/step_NNNNNNNN"
        )
    verify(path)
    return compose_config(safe_load(path / SHARED)["config"], overrides)


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


def evaluate_checkpoint(
    path: Path, cfg: Config, info: DistInfo, weights: str = "model"
) -> dict[str, Any]:
    try:
        ckpt = load_checkpoint(path, info, checksums=False)  # main() verified them
    except CheckpointError as exc:
        raise UserError(f"checkpoint: {exc}") from None
    seed_everything(cfg.seed)
    model, _ = build_model(cfg.model, info)
    data, data_extras = build_data(cfg.data)
    check_fits(model, data, cfg.model)
    task = build_task(cfg.task)
    averaged = averaged_weights(cfg, weights)
    components = RunState()
    if averaged is not None:
        averaged.attach(model)
        components.add("callbacks", CallbackList({weights: averaged}))
    try:  # collective under torchrun for a sharded checkpoint
        load_payload(ckpt, model, None, components)
    except CheckpointError as exc:
        raise UserError(f"checkpoint: {exc}") from None
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:  # overrides changed the model
        raise UserError(
            f"checkpoint: {path} does not fit the model its config builds with these overrides: "
            f"{summarize(exc)}. Drop the model.* overrides."
        ) from None
    _, val = build_batches(data, data_extras, cfg, info, accum=1)
    precision = Precision(cfg.train.precision, info.device.type)
    if averaged is None:
        means, count = evaluate(model, task, val, precision, info)
    else:
        with averaged.weights_swapped(model):
            means, count = evaluate(model, task, val, precision, info)
    return {"step": ckpt.step, **val_metrics(means, count, task)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    register_configs()
    register_resolvers()
    try:
        path, weights, overrides = parse_args(argv)
        check_overrides(overrides, CONFIG_DIR)
        cfg = checkpoint_config(path, overrides)
    except (UserError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # Hydra / OmegaConf: unknown key, bad type, unknown group option
        text = " ".join(str(exc).split("Config search path")[0].split())
        print(f"error: invalid override: {text}", file=sys.stderr)
        sys.exit(2)

    def body(config: Config, plain: dict[str, Any], info: DistInfo) -> None:
        metrics = evaluate_checkpoint(path, config, info, weights)
        if info.is_main:
            print(json.dumps(metrics), flush=True)

    run_command(cfg, body)


if __name__ == "__main__":
    main()
