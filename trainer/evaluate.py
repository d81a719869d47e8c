"""`python -m trainer.evaluate checkpoint=PATH [key=value ...]` (also under torchrun).

Rebuilds model and data from the checkpoint's own config, applies the overrides (e.g.
`eval.max_batches=null` for the whole validation split, `data.path=...`), evaluates, and
prints the metrics as one JSON object on the last line of stdout. Writes nothing.
`weights=ema` evaluates the EMA callback's averaged weights instead of the trained ones.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from engine.checkpoint import (
    SHARDS,
    SHARED,
    CheckpointError,
    LoadedCheckpoint,
    load_checkpoint,
    load_sharded,
    safe_load,
    verify,
)
from engine.distributed import DistInfo
from engine.evaluate import evaluate_loss
from engine.precision import Precision
from engine.sharded_checkpoint import saved_keys
from trainer.build import build_model, build_val_batches
from trainer.cli import run_command
from trainer.config import Config
from trainer.data import load_splits
from trainer.errors import UserError
from trainer.fit import summarize, val_metrics
from trainer.gpt import LanguageModelTask

USAGE = "usage: python -m trainer.evaluate checkpoint=PATH [weights=model|ema] [key=value ...]"


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


def averaged_weights(ckpt: LoadedCheckpoint) -> dict[str, bool]:
    """Callbacks whose averaged weights (`shadow`) the checkpoint holds, and whether they were
    saved shard by shard (FSDP's) rather than as plain tensors."""
    out = {}
    for name, state in ckpt.shared.get("callbacks", {}).items():
        shadow = state.get("shadow") if isinstance(state, dict) else None
        if shadow is not None and all(t is not None for t in shadow):
            out[name] = False
    if ckpt.layout == "sharded":
        for key in saved_keys(ckpt.path / SHARDS, "callbacks"):
            match = re.fullmatch(r"([^/]+)/shadow/\d+", key)
            if match:
                out[match.group(1)] = True
    return out


def load_weights(model: torch.nn.Module, ckpt: LoadedCheckpoint, weights: str) -> None:
    """The trained weights, or those a callback averaged (its `shadow`, in parameter order)."""
    averages = averaged_weights(ckpt)
    if weights != "model" and weights not in averages:
        raise UserError(
            f"weights={weights}: the checkpoint holds no averaged weights of that name; valid: "
            f"model{''.join(', ' + n for n in sorted(averages))}"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    averaged: list[torch.Tensor] = []
    extra = None
    if averages.get(weights):  # saved shard by shard: load into copies of the parameters
        averaged = [p.detach().clone() for p in params]
        extra = {"callbacks": {f"{weights}/shadow/{i}": t for i, t in enumerate(averaged)}}
    elif weights != "model":
        averaged = ckpt.shared["callbacks"][weights]["shadow"]
    if ckpt.layout == "sharded":  # collective under torchrun
        load_sharded(ckpt.path, model, optimizer=None, extra=extra)
    else:
        model.load_state_dict(ckpt.shared["model"])
    if averaged:
        with torch.no_grad():
            for p, avg in zip(params, averaged, strict=True):
                p.copy_(avg)


def evaluate_checkpoint(
    path: Path, cfg: Config, info: DistInfo, weights: str = "model"
) -> dict[str, Any]:
    try:
        ckpt = load_checkpoint(path, info, checksums=False)  # main() verified them
    except CheckpointError as exc:
        raise UserError(f"checkpoint: {exc}") from None
    splits = load_splits(cfg.data)
    model = build_model(cfg, splits, info)
    try:
        load_weights(model, ckpt, weights)
    except CheckpointError as exc:
        raise UserError(f"checkpoint: {exc}") from None
    except (RuntimeError, KeyError, ValueError) as exc:  # the overrides changed the model
        raise UserError(
            f"checkpoint: {path} does not fit the model its config builds with these overrides: "
            f"{summarize(exc)}. Drop the model.* overrides."
        ) from None
    batches = build_val_batches(cfg, splits, info)
    precision = Precision(cfg.train.precision, info.device.type)
    loss, count = evaluate_loss(model, LanguageModelTask(), batches, precision, info)
    return {"step": ckpt.step, **val_metrics(loss, count)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        path, weights, overrides = parse_args(argv)
        if not path.exists():
            raise UserError(
                f"checkpoint: {path} does not exist; expected a checkpoint directory such as "
                "RUN_DIR/checkpoints/step_NNNNNNNN"
            )
        verify(path)
        saved = safe_load(path / SHARED)["config"]
        cfg = OmegaConf.merge(
            OmegaConf.structured(Config), saved, OmegaConf.from_dotlist(overrides)
        )
    except (UserError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # OmegaConf: unknown key or bad type in an override
        print(f"error: invalid override: {exc}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)

    def body(config: Config, plain: dict[str, Any], info: DistInfo) -> None:
        metrics = evaluate_checkpoint(path, config, info, weights)
        if info.is_main:
            print(json.dumps(metrics), flush=True)

    run_command(cfg, body)


if __name__ == "__main__":
    main()
