"""A training run from start to end, as `python -m trainer.train` and `trainer.api.train` run
it: the run directory's lock held throughout, the run built (resuming from its checkpoints) and
fitted, and closed on every path with a summary, report.html and the trackers flushed."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config.schema import Config

if TYPE_CHECKING:
    from engine.distributed import DistInfo


def check_choices(cfg: Config) -> None:
    """The compatibility table's refusals that the config decides, its step and callbacks
    built (trainer/run/compatibility.py), before the world's size is checked and before any
    parallelism builds its process groups or mesh, so that one process reaches each of them:
    the entry points (trainer/train.py, trainer.api.train) call it before they join the
    process group, so every rank refuses alike and none waits for a peer that has exited in
    the rendezvous. The assembly asks the table again as it builds the data, the model and
    the task, and the run once its step is chosen."""
    from trainer.run.build import build_callbacks, build_step
    from trainer.run.compatibility import Choices

    dims = cfg.dist.dims()  # every degree checked, the world's size not yet
    step, callbacks = build_step(cfg.step), build_callbacks(cfg.callbacks, cfg.train)
    Choices.of(cfg, dims, training=True, step=step, callbacks=callbacks).checked()


def train(
    cfg: Config,
    plain: dict[str, Any],
    info: DistInfo,
    run_dir: Path,
    derived: dict[str, str] | None = None,
) -> None:
    """Build the run in `run_dir` (resuming from its checkpoints) and fit it, holding the run
    directory's lock throughout; a summary closes every run that ends on its own terms.
    `derived`: the config's keys that other keys give (trainer/config/trust.py:derived_keys),
    saved in its checkpoints so that evaluation derives them again."""
    # Imported here: `--help` and a refused config answer without loading torch.
    import torch

    from trainer.run.build import build_run
    from trainer.run.fit import RunEnded, fit, summary
    from trainer.run.hang import is_timeout, start_watch
    from trainer.tracking.report import write_run_report

    started = time.perf_counter()
    # Names the rank(s) a timed-out collective waited for (trainer/run/hang.py).
    watch = start_watch(info, run_dir, cfg.dist.timeout_s)
    try:
        with group_lock(run_dir, info, cfg):
            run = build_run(cfg, plain, run_dir, info, derived)
            if watch is not None:
                watch.follow(run.ctx.clock, lambda: run.checkpointer.committed)
            outcome, hung = None, False
            try:
                outcome = fit(run)
            except RunEnded as exc:  # diverged, or a checkpoint could not be written
                outcome = exc.outcome
                raise
            except BaseException as exc:
                run.profiler.on_error(exc)
                hung = is_timeout(exc)
                if not hung:
                    # A save in flight still commits: a sharded one needs the process group,
                    # which is torn down after this. Only this rank's own write is waited for:
                    # the other ranks may not be here.
                    run.checkpointer.wait()
                raise
            finally:
                torch.autograd.set_detect_anomaly(False)  # process-wide; don't leak into later runs
                # Rank 0 merges the profiled ranks' traces (briefly after an error: they may
                # never come).
                run.profiler.close(wait_s=60.0 if outcome is not None else 5.0)
                closing = None
                if info.is_main:
                    if outcome is not None:
                        closing = summary(run, outcome, time.perf_counter() - started)
                    if run.writes_run_files():  # before the trackers close: MLflow uploads
                        write_run_report(run_dir, closing)
                for sink in run.sinks:
                    sink.close()
                run.stop.close(collect=not hung)  # a hung peer would never finish it
                if closing is not None:
                    print(closing, flush=True)
    except Exception as exc:
        named = watch.explain(exc) if watch is not None else None
        if named is not None:
            raise named from None
        raise
    finally:
        if watch is not None:
            watch.stop()


def group_lock(run_dir: Path, info: DistInfo, cfg: Config) -> Any:
    """The run directory's lock; under ft each replica group holds its own (they share the
    directory), and a second launch of one group is refused naming `ft.group`."""
    import contextlib

    from trainer.run.lock import RunDirInUse, run_dir_lock

    if not cfg.ft.enabled:
        return run_dir_lock(run_dir, info)
    from trainer.run.ft import lock_name

    @contextlib.contextmanager
    def locked() -> Any:
        try:
            held = run_dir_lock(run_dir, info, lock_name(cfg.ft))
            held.__enter__()
        except RunDirInUse as exc:
            raise RunDirInUse(
                f"invalid config `ft.group`: replica group {cfg.ft.group} of this run is "
                f"running already (each group needs its own id in 0 .. {cfg.ft.groups - 1}): "
                f"{exc}"
            ) from None
        try:
            yield
        finally:
            held.__exit__(None, None, None)

    return locked()


def remove_if_unused(run_dir: Path) -> None:
    """A run directory that this launch created and that holds no record and no checkpoint
    (the run was refused before its first step) is removed: nothing is left to resume."""
    metrics = run_dir / "metrics.jsonl"
    if any(run_dir.glob("checkpoints/step_*")) or (metrics.exists() and metrics.stat().st_size):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
