"""Training from Python: the same run the command line starts, from a list of overrides.

    from trainer.api import train
    records = train(["model=tagger", "task=tagging", "data=tagging"], run_dir="runs/a",
                    config_dir="my_configs")

    metrics = evaluate("runs/a", ["eval.max_batches=null"], config_dir="my_configs")

Errors are raised (a `UserError` for bad input) instead of printed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def compose(overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> Any:
    """The composed config (a DictConfig), as `python -m trainer.train OVERRIDES` composes it.
    `config_dir` joins a folder of your own configs, like `hydra.searchpath=[file://DIR]`."""
    from trainer.config.cli import compose_train

    overrides = list(overrides)
    if config_dir is not None:
        overrides.append(f"hydra.searchpath=[file://{Path(config_dir).resolve()}]")
    return compose_train(overrides)


def train(
    overrides: Sequence[str] = (),
    *,
    run_dir: str | Path,
    config_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Train in this process (one rank, or one rank of a torchrun job) and return the run's
    records (`metrics.jsonl`). Rerunning with the same `run_dir` resumes, as on the command
    line."""
    import json

    from engine.distributed import init_distributed, shutdown_distributed
    from trainer.config.cli import to_config
    from trainer.config.trust import derived_keys
    from trainer.run.lifecycle import check_choices
    from trainer.run.lifecycle import train as train_run

    composed = compose(overrides, config_dir)
    cfg, plain = to_config(composed)
    check_choices(cfg)  # before the rendezvous: every rank refuses alike
    info = init_distributed(cfg.dist.backend, cfg.train.device, cfg.dist.timeout_s)
    run_dir = Path(run_dir)
    try:
        train_run(cfg, plain, info, run_dir, derived_keys(composed))
    finally:
        shutdown_distributed(clean=False)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line) for line in lines]  # strict JSON: non-finite values are null


def evaluate(
    checkpoint: str | Path,
    overrides: Sequence[str] = (),
    *,
    weights: str = "model",
    trust: Sequence[str] = (),
    saved_paths: bool = False,
    config_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint (or a run directory's newest valid one) in this process and
    return its metrics, as `python -m trainer.evaluate checkpoint=... OVERRIDES` prints them.

    A checkpoint of your own (signed with your secret: README, Security) needs neither. A
    received checkpoint's saved config is untrusted input: targets it names outside what
    cumulus ships must be under a `trust` prefix (`trust=["mypkg"]`) or in `config_dir`, and
    paths it sets must be restated in `overrides` (`"data.path=..."`) or taken with
    `saved_paths=True`.
    """
    from engine.distributed import init_distributed, shutdown_distributed
    from trainer.config.cli import check_overrides, to_config
    from trainer.config.schema import register_configs
    from trainer.run.assemble import CONFIG_DIR
    from trainer.run.evaluation import checkpoint_config, evaluate_checkpoint, resolve_checkpoint
    from trainer.run.identity import register_resolvers

    register_configs()
    register_resolvers()
    overrides = list(overrides)
    if config_dir is not None:
        overrides.append(f"hydra.searchpath=[file://{Path(config_dir).resolve()}]")
    check_overrides(overrides, CONFIG_DIR)
    path = resolve_checkpoint(Path(checkpoint).expanduser())
    cfg, _ = to_config(checkpoint_config(path, overrides, list(trust), saved_paths=saved_paths))
    info = init_distributed(cfg.dist.backend, cfg.train.device, cfg.dist.timeout_s)
    try:
        return evaluate_checkpoint(path, cfg, info, weights)
    finally:
        shutdown_distributed(clean=False)
