"""`python -m trainer.train [overrides]` or `torchrun --nproc_per_node=N -m trainer.train`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trainer.config.cli import check_overrides, compose_once, exit_with, run_command
from trainer.config.errors import UserError
from trainer.config.schema import register_configs
from trainer.config.trust import derived_keys
from trainer.run.identity import register_resolvers
from trainer.run.lifecycle import check_choices, remove_if_unused, train
from trainer.run.preemption import watch_launcher
from trainer.version import answer_version

register_configs()
register_resolvers()


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    fresh = run_dir.is_dir() and not any(run_dir.iterdir())  # Hydra just made it
    watch_launcher()  # under torchrun: stop if the launcher dies, from start-up on
    try:
        run_command(
            cfg,
            lambda config, plain, info: train(config, plain, info, run_dir, derived_keys(cfg)),
            before_joining=check_choices,  # before the rendezvous: every rank refuses alike
        )
    except SystemExit as exc:
        if exc.code and fresh and os.environ.get("RANK", "0") == "0":
            remove_if_unused(run_dir)
        raise


if __name__ == "__main__":
    answer_version(sys.argv[1:], "trainer.train")
    try:
        check_overrides(sys.argv[1:], Path(__file__).resolve().parent.parent / "configs")
    except UserError as exc:
        exit_with(exc)
    compose_once(sys.argv[1:])
    main()
