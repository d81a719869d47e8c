"""`python -m trainer.plan [training overrides] plan.world=W plan.gpu=h100 [plan.search=true]
[plan.out=PATH]`: the real run built for a simulated world of W GPUs on this machine, and
whether it fits, before anyone rents the GPUs (trainer/planning/; docs/plan.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from trainer.config.errors import ConfigError, UserError
from trainer.planning.progress import Progress
from trainer.version import answer_version


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    answer_version(argv, "trainer.plan")
    # Progress first: torch, transformers and the config take seconds before any simulation.
    error: UserError | ConfigError | None = None
    with Progress() as progress:
        progress.what = "importing torch and composing the config"
        try:
            result, cfg = _plan(argv, progress)
        except (UserError, ConfigError) as exc:
            error = exc
    if error is not None:
        from trainer.config.cli import exit_with

        exit_with(error)
        return
    _show(result, cfg)


def _plan(argv: list[str], progress: Progress) -> tuple[Any, Any]:
    from trainer.config.cli import compose_train, to_config
    from trainer.planning.plan import plan_run
    from trainer.planning.table import table

    cfg, _ = to_config(compose_train(argv))
    result = plan_run(cfg, progress)
    if cfg.plan.search:
        from trainer.planning.search import search

        print(table(result), flush=True)
        result.layouts = search(cfg, result, progress)
    return result, cfg


def _show(result: Any, cfg: Any) -> None:
    from trainer.planning.table import search_table, table

    if result.layouts is None:
        print(table(result), flush=True)
    else:
        capacity = result.gpu_memory_bytes * (1 - cfg.plan.headroom)
        print(search_table(result.layouts, capacity), flush=True)
    Path(cfg.plan.out).write_text(json.dumps(result.as_json(), indent=1))
    print(f"written: {cfg.plan.out}", flush=True)


if __name__ == "__main__":
    main()
