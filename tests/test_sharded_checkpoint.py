"""Sharded checkpoints (`checkpoint.format=sharded`, torch.distributed.checkpoint): the layout
on disk, resharding across world sizes and strategies, exact same-world resume, and the safety
of DCP's pickled `.metadata` and stored values.

Every resumed trajectory is compared with an uninterrupted run of the same global batch:
2 ranks DDP in the `full` layout (the independent reference), or the very same FSDP run for
the bitwise case. gloo on CPU, `model=gpt_tiny`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.filesystem import FileSystemReader

from engine.checkpoint import CheckpointError, verify
from engine.checkpoint.sharded import (
    UnsafeCheckpoint,
    load_sharded,
    load_shards,
    optimizer_layout,
    read_metadata,
    save_shards,
    sharded_model_optimizer_state,
)
from tests.conftest import CONFIG_DIR, TINY, read_metrics
from tests.old_dcp_layout import flat_state, old_state
from tests.ranks import explain, launch, torchrun_cmd
from trainer.models.gpt import GPT
from trainer.run.optim import param_groups

# DCP warns when it runs without a process group: the in-process unit tests mean to.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

COMMON = [
    *TINY,
    "data.packed=false",
    "train.max_steps=8",
    "eval.every_steps=4",
    "eval.max_batches=3",
    "eval.batch_size=5",
    "eval.sample_tokens=0",
    "checkpoint.every_steps=4",
]
TWO_RANKS = ["train.micro_batch_size=4", "train.grad_accum_steps=2"]  # global batch 16
ONE_RANK = ["train.micro_batch_size=8", "train.grad_accum_steps=2"]  # global batch 16
FSDP = ["dist.strategy=fsdp"]
CLI_TIMEOUT = 120.0
TORCHRUN_TIMEOUT = 180.0
BANNER = re.compile(r"resumed from (\S+) at step (\d+)")
TRAIN_KEYS = ("train/loss", "train/grad_norm", "train/lr")


# --------------------------------------------------------------------------- helpers


def train1(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """`python -m trainer.train args` (one process)."""
    return launch([sys.executable, "-m", "trainer.train", *args], CLI_TIMEOUT, tmp)


def train2(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=2 -m trainer.train args`."""
    return launch([*torchrun_cmd(2), "-m", "trainer.train", *args], TORCHRUN_TIMEOUT, tmp)


def evaluate(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    return launch([sys.executable, "-m", "trainer.evaluate", *args], CLI_TIMEOUT, tmp)


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def copy_ckpt(source: Path, step: int, dest_run: Path) -> Path:
    """Copy checkpoint `step` of run `source` into run directory `dest_run`."""
    dest = ckpt(dest_run, step)
    shutil.copytree(ckpt(source, step), dest)
    return dest


def manifest_of(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def resign(path: Path, name: str) -> None:
    """Rewrite the manifest entry of `path/name` so that its size and checksum pass."""
    manifest = manifest_of(path)
    data = (path / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))


def by_step(run_dir: Path) -> dict[tuple[int, str], dict[str, Any]]:
    """Last record of each (step, kind): a resumed run repeats the steps it redid."""
    out = {}
    for r in read_metrics(run_dir):
        out[(r["step"], "train" if "train/loss" in r else "val")] = r
    return out


def assert_close_trajectory(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert got, "no records"
    for key, record in got.items():
        ref = want[key]
        for name in ("train/loss", "train/grad_norm", "val/loss"):
            if name in ref:
                assert record[name] == pytest.approx(ref[name], rel=tol, abs=tol), (key, name)


def assert_resumed_at(proc: subprocess.CompletedProcess, run_dir: Path, step: int) -> None:
    """The run printed that it resumed from `step` and wrote records only after it."""
    assert [int(m.group(2)) for m in BANNER.finditer(proc.stdout)] == [step], explain(proc)
    got = by_step(run_dir)
    train_steps = sorted(s for s, kind in got if kind == "train")
    assert train_steps == list(range(step + 1, 9)), train_steps


class _Payload:
    """Unpickling this runs `touch marker`: what an unrestricted unpickler would execute."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def plant_metadata(path: Path, marker: Path) -> None:
    """Replace the DCP `.metadata` of checkpoint `path` by a code-running pickle, re-signed in
    the manifest so that only the safe unpickler stands between the file and execution."""
    shards = path / "shards"
    (shards / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    # The payload is live: DCP's own reader runs it (and only then fails on the result).
    with contextlib.suppress(Exception):
        FileSystemReader(shards).read_metadata()
    assert marker.exists()
    marker.unlink()
    resign(path, "shards/.metadata")


# --------------------------------------------------------------------------- shared runs


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def ddp_ref(root: Path) -> Path:
    """The reference: 2 ranks DDP, `full` checkpoints (the default under DDP)."""
    run_dir = root / "ddp_ref"
    proc = train2([*COMMON, *TWO_RANKS, f"hydra.run.dir={run_dir}"], root)
    assert proc.returncode == 0, explain(proc)
    assert manifest_of(ckpt(run_dir, 4))["layout"] == "full"
    return run_dir


@pytest.fixture(scope="module")
def fsdp_run(root: Path) -> Path:
    """2 ranks FSDP with default checkpoint settings: sharded, written inline."""
    run_dir = root / "fsdp"
    proc = train2([*COMMON, *TWO_RANKS, *FSDP, f"hydra.run.dir={run_dir}"], root)
    assert proc.returncode == 0, explain(proc)
    return run_dir


@pytest.fixture(scope="module")
def ddp_sharded(root: Path) -> Path:
    """2 ranks DDP with `checkpoint.format=sharded`."""
    run_dir = root / "ddp_sharded"
    args = [*COMMON, *TWO_RANKS, "checkpoint.format=sharded", f"hydra.run.dir={run_dir}"]
    proc = train2(args, root)
    assert proc.returncode == 0, explain(proc)
    return run_dir


# --------------------------------------------------------------------------- 1. layout


@pytest.mark.multiproc
def test_fsdp_writes_the_sharded_layout_by_default(fsdp_run: Path, ddp_ref: Path) -> None:
    """Every rank's DCP shard plus the metadata are listed with true sizes and checksums;
    state.pt holds the small state only; the shards hold the whole model at full shapes."""
    assert sorted(p.name for p in (fsdp_run / "checkpoints").iterdir()) == [
        "step_00000004",
        "step_00000008",
    ]  # no temporary directory left behind
    spec = yaml.safe_load((CONFIG_DIR / "model" / "gpt_tiny.yaml").read_text())
    model = GPT(
        **{k: v for k, v in spec.items() if k not in ("_target_", "activation_checkpointing")}
    )
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for step in (4, 8):
        path = ckpt(fsdp_run, step)
        manifest = manifest_of(path)
        assert manifest["layout"] == "sharded" and manifest["world_size"] == 2
        assert manifest["step"] == step
        files = manifest["files"]
        want = {"state.pt", "rank_00000.pt", "rank_00001.pt", "shards/.metadata"}
        want |= {f"shards/__{r}_0.distcp" for r in range(2)}
        assert set(files) == want
        on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {
            "manifest.json"
        }
        assert on_disk == want
        for name, entry in files.items():
            data = (path / name).read_bytes()
            assert entry["size"] == len(data), name
            assert entry["sha256"] == hashlib.sha256(data).hexdigest(), name
        assert verify(path)["layout"] == "sharded"

        state = torch.load(path / "state.pt", weights_only=True)
        assert "model" not in state and "optimizer" not in state, sorted(state)
        assert {"scheduler", "config"} <= set(state), sorted(state)

        metadata = read_metadata(path / "shards")
        stored = {
            k.removeprefix("model."): tuple(v.size)
            for k, v in metadata.state_dict_metadata.items()
            if k.startswith("model.")
        }
        assert stored == shapes  # global shapes, not a rank's shard
        assert any(k.startswith("optimizer.state.") for k in metadata.state_dict_metadata)
        # AdamW's settings once per group (weight decay on matrices, none elsewhere), naming
        # every parameter between them: not a value per parameter and setting.
        keys = metadata.state_dict_metadata
        settings = [k for k in keys if k.startswith("optimizer.") and ".state." not in k]
        assert len(settings) == 2, (len(settings), settings[:3])
        groups = {"optimizer": {k.removeprefix("optimizer."): None for k in settings}}
        load_shards(groups, path / "shards")
        assert sorted(v["weight_decay"] for v, _ in groups["optimizer"].values()) == [0.0, 0.1]
        named = sorted(n for _, names in groups["optimizer"].values() for n in names)
        moments = [k.split(".", 2)[2] for k in keys if k.endswith(".exp_avg")]
        assert named == sorted(k.removesuffix(".exp_avg") for k in moments)
        # Each rank wrote its own shard file.
        used = {info.relative_path for info in metadata.storage_data.values()}
        assert used == {"__0_0.distcp", "__1_0.distcp"}
    # Saving sharded does not disturb training: FSDP still follows the DDP reference.
    assert_close_trajectory(by_step(fsdp_run), by_step(ddp_ref))


# --------------------------------------------------------------------------- 2. reshard


@pytest.mark.multiproc
def test_fsdp_sharded_checkpoint_resumes_under_ddp(
    fsdp_run: Path, ddp_ref: Path, tmp_path: Path
) -> None:
    """FSDP shards, 2 ranks -> 2 ranks DDP: the continuation follows the DDP reference, and
    DDP then saves in the `full` layout (`auto`)."""
    run_dir = tmp_path / "run"
    copy_ckpt(fsdp_run, 4, run_dir)
    proc = train2([*COMMON, *TWO_RANKS, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert_resumed_at(proc, run_dir, 4)
    assert_close_trajectory(by_step(run_dir), by_step(ddp_ref))
    assert manifest_of(ckpt(run_dir, 8))["layout"] == "full"


@pytest.mark.multiproc
def test_ddp_sharded_checkpoint_resumes_under_fsdp(
    ddp_sharded: Path, ddp_ref: Path, tmp_path: Path
) -> None:
    """`checkpoint.format=sharded` under DDP: both ranks write a shard; it resumes under FSDP
    on 2 ranks on the reference trajectory."""
    source = ckpt(ddp_sharded, 4)
    manifest = manifest_of(source)
    assert manifest["layout"] == "sharded" and manifest["world_size"] == 2
    for r in range(2):
        assert manifest["files"][f"shards/__{r}_0.distcp"]["size"] > 0, manifest
    assert "model" not in torch.load(source / "state.pt", weights_only=True)
    # The format is a storage choice: the DDP trajectory itself is unchanged, bit for bit.
    ref = by_step(ddp_ref)
    for key, record in by_step(ddp_sharded).items():
        for name in (*TRAIN_KEYS, "val/loss"):
            assert record.get(name) == ref[key].get(name), (key, name)

    run_dir = tmp_path / "run"
    copy_ckpt(ddp_sharded, 4, run_dir)
    proc = train2([*COMMON, *TWO_RANKS, *FSDP, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert_resumed_at(proc, run_dir, 4)
    assert_close_trajectory(by_step(run_dir), ref)


@pytest.mark.multiproc
def test_ddp_sharded_checkpoint_resumes_on_one_process(
    ddp_sharded: Path, ddp_ref: Path, tmp_path: Path
) -> None:
    """2 ranks DDP sharded -> one plain process (no process group)."""
    run_dir = tmp_path / "run"
    copy_ckpt(ddp_sharded, 4, run_dir)
    proc = train1([*COMMON, *ONE_RANK, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert_resumed_at(proc, run_dir, 4)
    assert_close_trajectory(by_step(run_dir), by_step(ddp_ref))


# --------------------------------------------------------------------------- 3. 1 -> 2


@pytest.mark.multiproc
def test_one_process_sharded_checkpoint_resumes_under_fsdp(ddp_ref: Path, tmp_path: Path) -> None:
    """A single process writes one shard file; FSDP on 2 ranks resumes it on the trajectory."""
    single = tmp_path / "single"
    args = [*COMMON, *ONE_RANK, "checkpoint.format=sharded", f"hydra.run.dir={single}"]
    proc = train1(args, tmp_path)
    assert proc.returncode == 0, explain(proc)
    manifest = manifest_of(ckpt(single, 4))
    assert manifest["layout"] == "sharded" and manifest["world_size"] == 1
    assert sorted(n for n in manifest["files"] if n.startswith("shards/")) == [
        "shards/.metadata",
        "shards/__0_0.distcp",
    ]
    assert_close_trajectory(by_step(single), by_step(ddp_ref))

    run_dir = tmp_path / "run"
    copy_ckpt(single, 4, run_dir)
    proc = train2([*COMMON, *TWO_RANKS, *FSDP, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert_resumed_at(proc, run_dir, 4)
    assert_close_trajectory(by_step(run_dir), by_step(ddp_ref))


# --------------------------------------------------------------------------- 4. bitwise


@pytest.mark.multiproc
def test_same_world_fsdp_async_resume_is_bitwise(fsdp_run: Path, tmp_path: Path) -> None:
    """FSDP 2 ranks, async sharded saves, dropout: resuming from step 4 on the same ranks and
    strategy reproduces the uninterrupted run exactly (weights, optimizer, RNG per rank)."""
    args = [*COMMON, *TWO_RANKS, *FSDP, "model.dropout=0.1", "checkpoint.async_save=true"]
    full = tmp_path / "full"
    proc = train2([*args, f"hydra.run.dir={full}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert manifest_of(ckpt(full, 4))["layout"] == "sharded"
    want = by_step(full)
    # Dropout is on: the trajectory depends on the RNG streams a resume must restore.
    assert want[(1, "train")]["train/loss"] != by_step(fsdp_run)[(1, "train")]["train/loss"]

    run_dir = tmp_path / "run"
    copy_ckpt(full, 4, run_dir)
    proc = train2([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert_resumed_at(proc, run_dir, 4)
    got = by_step(run_dir)
    assert sorted(got) == sorted(k for k in want if k[0] > 4)
    for key, record in got.items():
        for name in (*TRAIN_KEYS, "val/loss"):
            assert record.get(name) == want[key].get(name), (key, name)


# --------------------------------------------------------------------------- 5. malicious


@pytest.mark.multiproc
def test_explicit_resume_of_malicious_metadata_is_refused(fsdp_run: Path, tmp_path: Path):
    """`checkpoint.resume=PATH` to a checkpoint whose `.metadata` would run code: one-line
    error, exit 2, nothing executed, nothing trained."""
    marker = tmp_path / "pwned"
    bad = copy_ckpt(fsdp_run, 8, tmp_path / "elsewhere")
    plant_metadata(bad, marker)
    with pytest.raises(CheckpointError, match="unsafe"):
        verify(bad)
    assert not marker.exists()

    run_dir = tmp_path / "run"
    args = [*COMMON, *ONE_RANK, f"checkpoint.resume={bad}", f"hydra.run.dir={run_dir}"]
    proc = train1(args, tmp_path)
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert re.search(r"error: checkpoint\.resume: .*unsafe.*system", proc.stderr), explain(proc)
    assert not marker.exists(), "the malicious metadata was executed"
    assert not (run_dir / "metrics.jsonl").exists(), "it trained instead of failing"
    assert bad.is_dir(), "the refused checkpoint was deleted"


@pytest.mark.multiproc
def test_auto_resume_skips_malicious_metadata(
    fsdp_run: Path, ddp_ref: Path, tmp_path: Path
) -> None:
    """`auto` skips the unsafe newest checkpoint with a warning and resumes from the older,
    valid one (resharded onto one process), on the reference trajectory."""
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    copy_ckpt(fsdp_run, 4, run_dir)
    plant_metadata(copy_ckpt(fsdp_run, 8, run_dir), marker)
    proc = train1([*COMMON, *ONE_RANK, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"skipping checkpoint: .*step_00000008.*unsafe", proc.stderr), explain(proc)
    assert not marker.exists(), "the malicious metadata was executed"
    assert_resumed_at(proc, run_dir, 4)
    assert_close_trajectory(by_step(run_dir), by_step(ddp_ref))
    assert verify(ckpt(run_dir, 8))["step"] == 8  # saved again, over the bad one


@pytest.mark.multiproc
def test_evaluate_refuses_malicious_metadata(fsdp_run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = copy_ckpt(fsdp_run, 8, tmp_path / "elsewhere")
    plant_metadata(bad, marker)
    proc = evaluate([f"checkpoint={bad}"], tmp_path)
    assert proc.returncode == 2, explain(proc)
    assert "unsafe" in proc.stderr and "Traceback" not in proc.stderr, explain(proc)
    assert not proc.stdout.strip().startswith("{"), explain(proc)
    assert not marker.exists(), "the malicious metadata was executed"


# --------------------------------------------------------------------------- 6. unit


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)},
        "extra": {"step": 7, "betas": (0.9, 0.95)},
    }


def test_save_and_load_shards_in_one_process(tmp_path: Path) -> None:
    """No process group: save, then fill zeroed tensors and empty slots in place."""
    path = tmp_path / "shards"
    original = _state()
    names = save_shards(original, path)
    assert names == sorted(p.name for p in path.iterdir())
    assert ".metadata" in names and "__0_0.distcp" in names
    target = {
        "model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)},
        "extra": {"step": None, "betas": None},
    }
    w = target["model"]["w"]
    load_shards(target, path)
    assert target["model"]["w"] is w  # in place
    assert torch.equal(target["model"]["w"], original["model"]["w"])
    assert torch.equal(target["model"]["b"], original["model"]["b"])
    assert target["extra"]["step"] == 7
    assert tuple(target["extra"]["betas"]) == (0.9, 0.95)
    # A key the checkpoint lacks is an error, not silently left as it was.
    with pytest.raises(RuntimeError, match=r"Missing key .*model\.missing"):
        load_shards({"model": {"w": torch.zeros(3, 4), "missing": torch.zeros(2)}}, path)


def _stepped_gpt(seed: int, steps: int) -> tuple[GPT, torch.optim.Optimizer]:
    """The tiny GPT (tied embedding) and AdamW with its two weight-decay groups, `steps` steps
    taken."""
    torch.manual_seed(seed)
    model = GPT(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    for _ in range(steps):
        model(torch.randint(0, 64, (2, 8))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


@pytest.mark.parametrize("layout", ["nested", "flat", "grouped"])
def test_every_optimizer_layout_loads(tmp_path: Path, layout: str) -> None:
    """The optimizer layout this version writes (settings once per group) and those of older
    sharded checkpoints (written here by the old code: nested; flattened, settings once per
    parameter) are told apart by their keys, and each loads into a fresh model and optimizer
    exactly: parameters, moments, step and groups, and the next step agrees bit for bit."""
    model, optimizer = _stepped_gpt(0, 2)
    write = {"nested": old_state, "flat": flat_state, "grouped": sharded_model_optimizer_state}
    save_shards(write[layout](model, optimizer), tmp_path / "shards")
    assert optimizer_layout(tmp_path / "shards") == layout
    fresh, fresh_optimizer = _stepped_gpt(1, 0)
    load_sharded(tmp_path, fresh, fresh_optimizer)
    assert fresh.lm_head.weight is fresh.tok_emb.weight  # still tied
    want, got = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, s in want["state"].items():
        assert sorted(got["state"][i]) == sorted(s)
        assert all(torch.equal(got["state"][i][k], v) for k, v in s.items()), i
    idx = torch.randint(0, 64, (2, 8))
    for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
        m(idx).square().mean().backward()
        o.step()
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


class _ListStateSGD(torch.optim.SGD):
    """SGD that also keeps a Python list per parameter: state DCP cannot flatten."""

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("seen", []).append(len(self.state[p]["seen"]) + 1)
        return out


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_and_unflattenable_optimizer_state_round_trip(tmp_path: Path, momentum: float) -> None:
    """SGD without state (momentum 0) and with it saves flattened (settings once per group);
    an optimizer whose state holds a list saves nested instead, and loads back."""
    for cls, layout in ((torch.optim.SGD, "grouped"), (_ListStateSGD, "nested")):
        path = tmp_path / cls.__name__
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = cls(model.parameters(), lr=0.1, momentum=momentum)
        model(torch.randn(2, 4)).square().sum().backward()
        optimizer.step()
        save_shards(sharded_model_optimizer_state(model, optimizer), path / "shards")
        assert optimizer_layout(path / "shards") == layout
        fresh = torch.nn.Linear(4, 3)
        fresh_optimizer = cls(fresh.parameters(), lr=0.5, momentum=momentum)
        load_sharded(path, fresh, fresh_optimizer)
        assert torch.equal(fresh.weight, model.weight)
        want, got = optimizer.state_dict(), fresh_optimizer.state_dict()
        assert got["param_groups"] == want["param_groups"]
        for i, s in want["state"].items():
            for k, v in s.items():
                assert (
                    torch.equal(got["state"][i][k], v)
                    if torch.is_tensor(v)
                    else v == got["state"][i][k]
                ), (i, k)


def _rewrite_storage(path: Path, **changes: Any) -> None:
    """Change the first storage entry of `path/.metadata` (plain pickle: trusted here)."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **changes)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("name", ["../outside.distcp", "/tmp/absolute.distcp", "sub/x.distcp"])
def test_metadata_pointing_outside_is_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / "ckpt" / "shards"
    save_shards(_state(), path)
    read_metadata(path)  # the untouched metadata is fine
    _rewrite_storage(path, relative_path=name)
    if name.startswith("../"):
        # Stock DCP follows the path out of the checkpoint directory.
        shutil.copy(path / "__0_0.distcp", path.parent / "outside.distcp")
        target = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}}
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    with pytest.raises(UnsafeCheckpoint, match="outside"):
        read_metadata(path)
    with pytest.raises(UnsafeCheckpoint):
        load_shards({"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}}, path)


def test_metadata_with_storage_transforms_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "shards"
    save_shards(_state(), path)
    _rewrite_storage(path, transform_descriptors=["zstd"])
    with pytest.raises(UnsafeCheckpoint, match="transform"):
        read_metadata(path)


def test_metadata_that_runs_code_or_is_garbage_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "shards"
    save_shards(_state(), path)
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match="system"):
        read_metadata(path)
    with pytest.raises(UnsafeCheckpoint):
        load_shards({"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}}, path)
    assert not marker.exists()
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(UnsafeCheckpoint, match="unreadable"):
        read_metadata(path)


class _ByName:
    """Pickles as `getattr(owner, name)`."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return (getattr, (self.owner, self.name))


class _EnumsByName(pickle.Pickler):
    """Pickles Enum members as `getattr(Enum, "NAME")`, as Python 3.11.2 (Debian 12's system
    Python) does; 3.11.7 calls the class with the member's value instead."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return (getattr, (type(obj), obj.name))
        return NotImplemented


def test_enum_members_pickled_by_name_load(tmp_path: Path) -> None:
    """A checkpoint saved by a Python that pickles DCP's enum members by name loads; getattr
    on anything else (a method of an allowed class, an enum's non-member attribute) is refused."""
    path = tmp_path / "shards"
    save_shards(_state(), path)
    metadata = read_metadata(path)
    with (path / ".metadata").open("wb") as f:
        _EnumsByName(f).dump(metadata)
    assert b"getattr" in (path / ".metadata").read_bytes()
    assert read_metadata(path).state_dict_metadata.keys() == metadata.state_dict_metadata.keys()
    target = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}}
    load_shards(target, path)
    assert torch.equal(target["model"]["w"], _state()["model"]["w"])
    from torch.distributed.checkpoint import metadata as dcp_metadata

    members = dcp_metadata._MEM_FORMAT_ENCODING
    for owner, name in ((Path, "write_text"), (members, "__class__"), (members, "mro")):
        (path / ".metadata").write_bytes(pickle.dumps(_ByName(owner, name)))
        with pytest.raises(UnsafeCheckpoint, match=r"getattr\(.*not allowed"):
            read_metadata(path)


class _Evil:
    """A stored non-tensor value whose unpickling runs `touch marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_stored_value_that_runs_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "shards"
    save_shards({"t": torch.ones(2), "obj": _Evil(marker)}, path)  # DCP torch.saves it as bytes
    assert not marker.exists()
    read_metadata(path)  # the metadata itself is clean
    # The payload is live: stock DCP loading runs it.
    dcp.load(
        {"t": torch.zeros(2), "obj": None}, storage_reader=FileSystemReader(path), no_dist=True
    )
    assert marker.exists()
    marker.unlink()
    target = {"t": torch.zeros(2), "obj": None}
    with pytest.raises(UnsafeCheckpoint, match="obj"):
        load_shards(target, path)
    assert not marker.exists(), "the stored value was executed"
    assert target["obj"] is None


# --------------------------------------------------------------------------- 7. corrupt


@pytest.mark.multiproc
def test_corrupt_shard_is_reported_and_skipped(
    fsdp_run: Path, ddp_ref: Path, tmp_path: Path
) -> None:
    """One flipped byte in rank 1's shard: `verify` names the file; `auto` falls back."""
    run_dir = tmp_path / "run"
    copy_ckpt(fsdp_run, 4, run_dir)
    bad = copy_ckpt(fsdp_run, 8, run_dir)
    shard = bad / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte differs
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"shards/__1_0\.distcp does not match its checksum"):
        verify(bad)

    proc = train1([*COMMON, *ONE_RANK, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"skipping checkpoint: .*step_00000008.*__1_0\.distcp", proc.stderr), explain(
        proc
    )
    assert_resumed_at(proc, run_dir, 4)
    assert_close_trajectory(by_step(run_dir), by_step(ddp_ref))


# --------------------------------------------------------------------------- 8. evaluate


@pytest.mark.multiproc
def test_evaluate_reads_a_sharded_checkpoint(fsdp_run: Path, tmp_path: Path) -> None:
    """`trainer.evaluate` on a 2-rank FSDP checkpoint, in one process, gets the run's val/loss
    (the checkpoint's own config: the same 15 validation samples)."""
    trained = by_step(fsdp_run)[(8, "val")]
    proc = evaluate([f"checkpoint={ckpt(fsdp_run, 8)}"], tmp_path)
    assert proc.returncode == 0, explain(proc)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["step"] == 8
    assert got["val/items"] == trained["val/items"]
    assert math.isclose(got["val/loss"], trained["val/loss"], rel_tol=1e-5), (got, trained)


def test_verify_shares_split_the_hashing(tmp_path: Path) -> None:
    """n ranks verifying together each hash a disjoint share of the files: a flipped byte is
    caught by exactly one share, and by the single-process `verify_together`."""
    from engine.checkpoint import verify_together, write_checkpoint
    from engine.distributed import DistInfo

    per_rank = [{"rng": torch.arange(8) + r} for r in range(3)]
    ckpt = write_checkpoint(tmp_path, 5, {"w": torch.ones(16)}, per_rank, "s")
    assert verify_together(ckpt, DistInfo()) is None
    victim = ckpt / "rank_00001.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    caught = 0
    for i in range(3):
        try:
            verify(ckpt, share=(i, 3))
        except CheckpointError as exc:
            assert "rank_00001.pt does not match its checksum" in str(exc)
            caught += 1
    assert caught == 1
    assert "rank_00001.pt" in (verify_together(ckpt, DistInfo()) or "")


def test_metadata_that_sets_attributes_of_a_class_is_refused(tmp_path: Path) -> None:
    """Pickle's BUILD on an allow-listed *class* would set attributes process-wide (here: make
    `PurePosixPath.name` lie, which the outside-the-directory check relies on): refused, and
    the class is left untouched."""
    from pathlib import PurePosixPath

    name = b"../../private/__0_0.distcp"
    evil = (
        b"\x80\x02cpathlib\nPurePosixPath\nN}X\x04\x00\x00\x00nameX"
        + len(name).to_bytes(4, "little")
        + name
        + b"s\x86b."
    )
    (tmp_path / ".metadata").write_bytes(evil)
    with pytest.raises(UnsafeCheckpoint, match=r"sets attributes of <class 'pathlib\.PurePos"):
        read_metadata(tmp_path)
    assert PurePosixPath("a/b").name == "b"


def test_metadata_without_its_tables_is_refused(tmp_path: Path) -> None:
    """Crafted metadata of the right class but missing what loading relies on: refused by
    `read_metadata` (so `verify` skips it) rather than failing later inside DCP."""
    save_shards({"t": torch.ones(2)}, tmp_path)
    metadata = read_metadata(tmp_path)
    for broken in ({"storage_data": None}, {"storage_data": [1]}, {"state_dict_metadata": {1: 2}}):
        (tmp_path / ".metadata").write_bytes(pickle.dumps(dataclasses.replace(metadata, **broken)))
        with pytest.raises(UnsafeCheckpoint):
            read_metadata(tmp_path)


def test_paths_into_callback_state_round_trip() -> None:
    """The paths `split_dtensors` names callback tensors by lead back to them through dicts
    with non-string keys, lists and tuples (rebuilt, not mutated)."""
    from engine.checkpoint.sharded import get_path, with_path

    state = {"ema": {"pair": (torch.zeros(1), torch.ones(1)), 3: [None, torch.full((1,), 2.0)]}}
    assert torch.equal(get_path(state, "ema/pair/1"), torch.ones(1))
    assert torch.equal(get_path(state, "ema/3/1"), torch.full((1,), 2.0))
    out = with_path(state, "ema/pair/0", torch.full((1,), 7.0))
    out = with_path(out, "ema/3/0", torch.full((1,), 8.0))
    assert isinstance(out["ema"]["pair"], tuple)
    assert out["ema"]["pair"][0].item() == 7.0 and out["ema"][3][0].item() == 8.0
    with pytest.raises(KeyError):
        get_path(state, "ema/4/0")
