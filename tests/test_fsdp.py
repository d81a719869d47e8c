"""FSDP2 (`dist.strategy=fsdp`) follows DDP, EMA of sharded weights included, and checkpoints
reshard across strategies and world sizes. gloo on CPU, 2 ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY, read_metrics
from tests.ranks import explain, run_cli, run_torchrun

pytestmark = pytest.mark.multiproc

COMMON = [
    *TINY,
    "data.packed=false",
    "train.max_steps=8",
    "eval.every_steps=4",
    "eval.max_batches=3",
    "eval.batch_size=5",  # 15 validation samples: shards of 8 and 7
    "eval.sample_tokens=8",
    "checkpoint.every_steps=4",
    "callbacks=ema",  # sharded like the parameters under FSDP; evaluated as val/loss_ema
]
TWO_RANKS = ["train.micro_batch_size=4", "train.grad_accum_steps=2"]
ONE_RANK = ["train.micro_batch_size=8", "train.grad_accum_steps=2"]


def by_step(run_dir: Path) -> dict[tuple[int, str], dict]:
    """Last record of each (step, kind): a resumed run repeats steps it redid."""
    out = {}
    for r in read_metrics(run_dir):
        out[(r["step"], "train" if "train/loss" in r else "val")] = r
    return out


METRICS = ("train/loss", "train/grad_norm", "val/loss", "val/loss_ema")


def assert_same_trajectory(
    got: dict, want: dict, tol: float = 1e-5, metrics: tuple[str, ...] = METRICS
) -> None:
    assert got, "no records"
    for key, record in got.items():
        ref = want[key]
        for name in metrics:
            if name in ref:
                assert record[name] == pytest.approx(ref[name], rel=tol, abs=tol), (key, name)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    proc = run_torchrun(2, [*COMMON, *TWO_RANKS, f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, explain(proc)
    return run_dir


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    proc = run_torchrun(2, [*COMMON, *TWO_RANKS, "dist.strategy=fsdp", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, explain(proc)
    return run_dir


def test_fsdp_follows_ddp(ddp_run: Path, fsdp_run: Path) -> None:
    """Same losses, unscaled grad norms (clipping active at 1.0) and validation losses, of the
    weights and of their EMA."""
    fsdp, ddp = by_step(fsdp_run), by_step(ddp_run)
    assert set(fsdp) == set(ddp)
    assert ddp[(8, "val")]["val/loss_ema"] != ddp[(8, "val")]["val/loss"]  # a real average
    assert ddp[(1, "train")]["train/grad_norm"] > 1.0  # so clipping did something
    assert_same_trajectory(fsdp, ddp)
    # Generation runs in lockstep on every rank; rank 0's sample matches DDP's.
    assert fsdp[(8, "val")]["val/sample"] == ddp[(8, "val")]["val/sample"]


def test_fsdp_sync_every_micro_batch(ddp_run: Path, tmp_path: Path) -> None:
    """Reduce-scattering every micro-batch changes memory and traffic, not the result."""
    run_dir = tmp_path / "run"
    args = [*COMMON, *TWO_RANKS, "dist.strategy=fsdp", "dist.fsdp_sync_every_micro_batch=true"]
    proc = run_torchrun(2, [*args, "checkpoint.every_steps=0", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, explain(proc)
    assert_same_trajectory(by_step(run_dir), by_step(ddp_run))


def resume_from(source: Path, step: int, dest: Path) -> Path:
    """A fresh run dir holding only checkpoint `step` of `source`."""
    name = f"step_{step:08d}"
    shutil.copytree(source / "checkpoints" / name, dest / "checkpoints" / name)
    return dest


def test_fsdp_checkpoint_resumes_on_one_process(fsdp_run: Path, ddp_run: Path, tmp_path: Path):
    """Saved sharded on 2 ranks, resumed unsharded on 1: continues the same trajectory."""
    run_dir = resume_from(fsdp_run, 4, tmp_path / "run")
    proc = run_cli([*COMMON, *ONE_RANK, f"hydra.run.dir={run_dir}"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    got = by_step(run_dir)
    assert min(step for step, _ in got) == 5  # continued after step 4, did not start over
    assert_same_trajectory(got, by_step(ddp_run))


def test_ddp_checkpoint_resumes_under_fsdp(ddp_run: Path, tmp_path: Path) -> None:
    """A DDP checkpoint resumes sharded under FSDP, and an FSDP one under DDP."""
    run_dir = resume_from(ddp_run, 4, tmp_path / "to_fsdp")
    args = [*COMMON, *TWO_RANKS, f"hydra.run.dir={run_dir}"]
    proc = run_torchrun(2, [*args, "dist.strategy=fsdp"])
    assert proc.returncode == 0, explain(proc)
    assert_same_trajectory(by_step(run_dir), by_step(ddp_run))


def test_one_process_checkpoint_resumes_sharded_on_two(ddp_run: Path, tmp_path: Path) -> None:
    """1 -> 2: a single-process checkpoint resumes under FSDP on 2 ranks, on the trajectory."""
    single = tmp_path / "single"
    proc = run_cli([*COMMON, *ONE_RANK, f"hydra.run.dir={single}"])  # same LR schedule
    assert proc.returncode == 0, explain(proc)
    run_dir = resume_from(single, 4, tmp_path / "to_fsdp")
    proc = run_torchrun(2, [*COMMON, *TWO_RANKS, "dist.strategy=fsdp", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, explain(proc)
    assert_same_trajectory(by_step(run_dir), by_step(ddp_run))


def test_evaluate_reads_sharded_ema_weights(fsdp_run: Path) -> None:
    """`trainer.evaluate weights=ema` on FSDP's sharded checkpoint, in one process, gives the
    EMA validation loss the 2-rank run logged at that step (and the plain weights theirs)."""
    ckpt = fsdp_run / "checkpoints" / "step_00000008"
    logged = by_step(fsdp_run)[(8, "val")]
    for weights, key in (("ema", "val/loss_ema"), ("model", "val/loss")):
        proc = run_cli([f"checkpoint={ckpt}", f"weights={weights}"], module="trainer.evaluate")
        assert proc.returncode == 0, explain(proc)
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["step"] == 8
        assert got["val/loss"] == pytest.approx(logged[key], rel=1e-6), weights


def test_ema_with_full_checkpoints_under_fsdp_is_refused(tmp_path: Path) -> None:
    """A full checkpoint would not gather EMA's sharded average: refused before training, in
    one paragraph naming the key and the remedy."""
    args = [*COMMON, *TWO_RANKS, "dist.strategy=fsdp", "checkpoint.format=full"]
    proc = run_torchrun(2, [*args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode != 0
    assert "checkpoint.format" in proc.stderr and "checkpoint.format=sharded" in proc.stderr
    assert "error: invalid config `checkpoint.format`" in proc.stderr, explain(proc)
    assert "exitcode  : 2" in proc.stderr  # the workers' bad-input exit, not a crash
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sharded_checkpoint_resumes_without_its_ema(fsdp_run: Path, ddp_run: Path, tmp_path):
    """Dropping a callback on resume is allowed in both layouts: the EMA shards saved under
    FSDP are left unread, training continues on the trajectory."""
    run_dir = resume_from(fsdp_run, 4, tmp_path / "run")
    args = [a for a in COMMON if a != "callbacks=ema"]
    proc = run_cli([*args, *ONE_RANK, f"hydra.run.dir={run_dir}"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    assert "at step 4" in proc.stdout
    got = by_step(run_dir)
    assert "val/loss_ema" not in got[(8, "val")]
    assert_same_trajectory(got, by_step(ddp_run), metrics=METRICS[:3])


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_fsdp_needs_a_validation_sample_per_rank(strategy: str) -> None:
    """FSDP evaluates in lockstep: a validation set smaller than its data-parallel size is a
    config error naming eval.max_batches (asked of the parallelism, no process group needed);
    DDP takes the same set."""
    from engine.distributed import DistInfo
    from engine.parallel.dims import build_parallelism
    from tests.conftest import compose_config
    from trainer.config.cli import to_config
    from trainer.config.errors import ConfigError
    from trainer.data.batches import build_val_batches
    from trainer.run.assemble import build_data

    evals = ["eval.every_steps=5", "eval.batch_size=1", "eval.max_batches=1"]
    overrides = [*TINY, f"dist.strategy={strategy}", *evals]
    cfg, _ = to_config(compose_config(overrides))
    data, extras = build_data(cfg.data)
    info = DistInfo(rank=0, world_size=2)
    parallel = build_parallelism(strategy, info)
    if strategy == "ddp":
        assert len(build_val_batches(data, extras, cfg.eval, cfg.seed, info, parallel)) == 1
        return
    with pytest.raises(ConfigError, match=r"eval\.max_batches.*2 ranks; the set has 1"):
        build_val_batches(data, extras, cfg.eval, cfg.seed, info, parallel)
