"""`python -m trainer.evaluate checkpoint=PATH [key=value ...]` (also under torchrun).

Rebuilds model and data from the checkpoint's own config, applies the overrides (e.g.
`eval.max_batches=null` for the whole validation split, `data.path=...`), evaluates, and
prints the metrics as one JSON object on the last line of stdout. Writes nothing.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from engine.checkpoint import SHARED, CheckpointError, load_checkpoint, safe_load, verify
from engine.distributed import DistInfo
from engine.evaluate import evaluate_loss
from engine.precision import Precision
from trainer.build import build_model
from trainer.cli import run_command
from trainer.config import Config
from trainer.data import eval_batches, load_splits
from trainer.errors import UserError
from trainer.gpt import LanguageModelTask

USAGE = "usage: python -m trainer.evaluate checkpoint=PATH [key=value ...]"


def parse_args(argv: list[str]) -> tuple[Path, list[str]]:
    ckpt = [a.split("=", 1)[1] for a in argv if a.startswith("checkpoint=")]
    rest = [a for a in argv if not a.startswith("checkpoint=")]
    if len(ckpt) != 1 or not ckpt[0]:
        raise UserError(f"checkpoint=PATH is required exactly once. {USAGE}")
    bad = [a for a in rest if "=" not in a]
    if bad:
        raise UserError(f"overrides must look like key=value, got {bad}. {USAGE}")
    return Path(ckpt[0]).expanduser(), rest


def evaluate_checkpoint(path: Path, cfg: Config, info: DistInfo) -> dict[str, Any]:
    try:
        ckpt = load_checkpoint(path, info)
    except CheckpointError as exc:
        raise UserError(f"checkpoint: {exc}") from None
    splits = load_splits(cfg.data)
    model = build_model(cfg, splits, info)
    model.load_state_dict(ckpt.shared["model"])
    batches = eval_batches(
        splits.val,
        rank=info.rank,
        world_size=info.world_size,
        batch_size=cfg.eval.batch_size,
        max_batches=cfg.eval.max_batches,
        device=info.device,
    )
    loss, count = evaluate_loss(
        model, LanguageModelTask(), batches, Precision(cfg.train.precision, info.device.type), info
    )
    return {
        "step": ckpt.step,
        "val/loss": loss,
        "val/ppl": math.exp(min(loss, 700.0)),
        "val/items": count,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        path, overrides = parse_args(argv)
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
        metrics = evaluate_checkpoint(path, config, info)
        if info.is_main:
            print(json.dumps(metrics), flush=True)

    run_command(cfg, body)


if __name__ == "__main__":
    main()
