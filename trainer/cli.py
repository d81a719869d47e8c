"""What every command does around its work: validate the config, join the process group, turn
errors into one paragraph and an exit code."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.distributed import DistInfo, init_distributed, shutdown_distributed
from trainer.config import Config
from trainer.errors import UserError

T = TypeVar("T")
EXIT_USER_ERROR = 2


def to_config(cfg: DictConfig) -> tuple[Config, dict[str, Any]]:
    """Validated dataclasses (runs every `__post_init__`) and the resolved plain dict."""
    try:
        obj = OmegaConf.to_object(cfg)
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, UserError) else None
        if cause is not None:
            raise cause from None
        raise UserError(f"invalid config: {exc}".replace("\n", " ")) from None
    return obj, plain  # type: ignore[return-value]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_command(cfg: DictConfig, body: Callable[[Config, dict[str, Any], DistInfo], T]) -> T:
    """Validate, join the process group, run `body`, leave cleanly; exit non-zero on error."""
    info: DistInfo | None = None
    try:
        config, plain = to_config(cfg)
        info = init_distributed(config.dist.backend, config.train.device, config.dist.timeout_s)
        result = body(config, plain, info)
    except UserError as exc:
        # Config errors hit every rank alike: one copy is enough. Others name their rank.
        if info is None or not info.distributed:
            if _rank() == 0:
                print(f"error: {exc}", file=sys.stderr, flush=True)
        else:
            print(f"error (rank {info.rank}): {exc}", file=sys.stderr, flush=True)
        shutdown_distributed(clean=False)
        sys.exit(EXIT_USER_ERROR)
    except Exception:
        prefix = f"[rank {info.rank}] " if info is not None and info.distributed else ""
        print(f"{prefix}training failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        shutdown_distributed(clean=False)
        sys.exit(1)
    shutdown_distributed(clean=True)
    return result
