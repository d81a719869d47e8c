"""`python -m trainer.evaluate checkpoint=PATH [overrides]` (also under torchrun).

PATH is a checkpoint directory or a run directory (its newest valid checkpoint). Rebuilds the
run's model, task and data from the checkpoint's own config with the overrides on top,
exactly as training takes them (`eval.max_batches=null` for the whole validation split,
`data.path=...`, group selections such as `data=...` or `model=gpt_tiny`,
`hydra.searchpath=[file://DIR]` for a user's config folder), evaluates, and prints the
metrics as one JSON object on the last line of stdout. Writes nothing.
`weights=NAME` evaluates the weights an averaging callback (`ema`) kept instead.

A checkpoint of the user's own (its config signed with their secret,
trainer/config/signing.py) is evaluated as trained, with no flag. A received one's saved config
is untrusted input (trainer/config/trust.py): only targets cumulus ships, targets the user
restates and those under `trust=[PKG,...]` are built; paths it sets (data, tokenizer,
pretrained model, cache) are refused unless restated on the command line (`data.path=...`)
or taken with `saved_paths=true`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from engine.checkpoint import CheckpointError
from engine.distributed import DistInfo
from trainer.config.cli import check_overrides, run_command
from trainer.config.errors import UserError
from trainer.config.schema import Config, register_configs
from trainer.config.trust import parse_saved_paths, parse_trust
from trainer.run.assemble import CONFIG_DIR
from trainer.run.evaluation import checkpoint_config, evaluate_checkpoint, resolve_checkpoint
from trainer.run.identity import register_resolvers
from trainer.version import answer_version

USAGE = (
    "usage: python -m trainer.evaluate checkpoint=PATH|RUN_DIR [weights=model|NAME] "
    "[trust=[PKG,...]] [saved_paths=true] [key=value ...]"
)


def parse_args(argv: list[str]) -> tuple[Path, str, list[str], bool, list[str]]:
    """`checkpoint=PATH`, `weights=model|NAME` (a weight-averaging callback such as `ema`),
    `trust=[PKG,...]` (module prefixes whose targets the checkpoint's config may name),
    `saved_paths=true` (use the paths it names), and the config overrides."""
    trust, argv = parse_trust(argv)
    saved_paths, argv = parse_saved_paths(argv)
    ckpt = [a.split("=", 1)[1] for a in argv if a.startswith("checkpoint=")]
    weights = [a.split("=", 1)[1] for a in argv if a.startswith("weights=")]
    rest = [a for a in argv if not a.startswith(("checkpoint=", "weights="))]
    if len(ckpt) != 1 or not ckpt[0]:
        raise UserError(f"checkpoint=PATH is required exactly once. {USAGE}")
    bad = [a for a in rest if "=" not in a]
    if bad:
        raise UserError(f"overrides must look like key=value, got {bad}. {USAGE}")
    return Path(ckpt[0]).expanduser(), (weights or ["model"])[-1], trust, saved_paths, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    answer_version(argv, "trainer.evaluate")
    register_configs()
    register_resolvers()
    try:
        path, weights, trust, saved_paths, overrides = parse_args(argv)
        check_overrides(overrides, CONFIG_DIR)
        path = resolve_checkpoint(path)
        cfg = checkpoint_config(path, overrides, trust, saved_paths=saved_paths)
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
