"""A user's own model, task and dataset, from outside the package, keep every guarantee.

The project is docs/your-model.md's sequence tagger (written out of the doc by
`tests.user_project`): a package on PYTHONPATH and a config folder joined with
`hydra.searchpath`, selected on the command line as `model=tagger task=tagging data=tagging`.
Its sequences have 0 to 6 positions, padded per micro-batch by `pad_collate` (tags with
-100), so micro-batches hold different numbers of loss items and some samples none at all.

References are computed here, independently of the trainer: full-batch gradient descent in
float64 with a plain autograd loop over the whole (tiny) training set.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.distributed import DistInfo
from engine.parallel.dims import build_parallelism
from tests.conftest import REPO, compose_config, read_metrics, train_records
from tests.ranks import explain, launch, launch_all, torchrun_cmd
from tests.user_project import select, write_project
from trainer.config.cli import to_config
from trainer.config.errors import ConfigError
from trainer.run.assemble import split_extras
from trainer.run.layout import parallelize

SEED = 1337  # the trainer's default seed
STEPS = 8
LR = 0.5
TIMEOUT = 150.0
# Plain full-batch gradient descent: the whole 8-sample training set is each step's global
# batch (in a different order each epoch, which a sum does not see).
EXACT = [
    "data.n_train=8",
    "data.n_val=4",
    "optim=sgd",
    "optim.momentum=0.0",
    "optim.weight_decay=0.0",
    f"optim.lr={LR}",
    "scheduler=constant",
    "train.clip_grad_norm=null",
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "eval.every_steps=0",
    f"checkpoint.every_steps={STEPS}",
    "logger=none",
]
ONE = ["train.micro_batch_size=8", "train.grad_accum_steps=1"]
TWO = ["train.micro_batch_size=2", "train.grad_accum_steps=2"]  # x 2 ranks = 8


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_project(tmp_path_factory.mktemp("user_project"))


def trainer(root: Path, run_dir: Path, *extra: str, nproc: int = 1) -> list[str]:
    args = [*select(root), *extra, f"hydra.run.dir={run_dir}"]
    launcher = torchrun_cmd(nproc) if nproc > 1 else [sys.executable]
    return [*launcher, "-m", "trainer.train", *args]


def user_module(root: Path) -> Any:
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("tagger")
    finally:
        sys.path.remove(str(root))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step_{STEPS:08d}" / "state.pt"
    return torch.load(path, weights_only=True)["model"]


def reference(root: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses at each step and the final weights of full-batch GD in float64."""
    tagger = user_module(root)
    torch.manual_seed(SEED)  # what the trainer seeds before it builds the model
    model = tagger.Tagger(features=5, hidden=32, classes=4, dtype="float64")
    train = tagger.tagging_data(n_train=8, n_val=4, dtype="float64")["train"]
    # Unpadded: each sample on its own, (T_i, 5) features and T_i tags.
    xs = [train[i]["features"] for i in range(len(train))]
    ys = [torch.tensor(train[i]["labels"], dtype=torch.int64) for i in range(len(train))]
    assert [len(y) for y in ys] == [0, 1, 2, 3, 4, 5, 6, 0]  # uneven, two samples empty
    items = sum(len(y) for y in ys)
    params = list(model.parameters())
    losses = []
    for _ in range(STEPS):
        loss = sum(F.cross_entropy(model(x), y, reduction="sum") for x, y in zip(xs, ys)) / items
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= LR * g
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def exact_runs(project: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """1 process x micro 8 and 2 ranks x micro 2 x accum 2, in float64 and float32."""
    root = tmp_path_factory.mktemp("exact")
    runs = {
        "one_fp64": (ONE, 1, "float64"),
        "two_fp64": (TWO, 2, "float64"),
        "one_fp32": (ONE, 1, "float32"),
        "two_fp32": (TWO, 2, "float32"),
    }
    cmds = {
        name: trainer(project, root / name, *EXACT, *split, f"model.dtype={dtype}", nproc=n)
        for name, (split, n, dtype) in runs.items()
    }
    results = {}
    for pair in (("one_fp64", "two_fp64"), ("one_fp32", "two_fp32")):  # 3 processes at a time
        results |= launch_all({k: cmds[k] for k in pair}, TIMEOUT, PYTHONPATH=str(project))
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
    return {name: root / name for name in runs}


def losses(run_dir: Path) -> list[float]:
    records = train_records(read_metrics(run_dir))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["train/loss"] for r in records]


@pytest.mark.multiproc
def test_float64_trainer_is_full_batch_gradient_descent(
    project: Path, exact_runs: dict[str, Path]
) -> None:
    """1 process and 2 ranks x accum 2, with uneven and empty micro-batches, equal plain
    full-batch GD to 1e-10 in float64: the loss at every step and the final weights."""
    want_losses, want_weights = reference(project)
    assert want_losses[-1] < want_losses[0] - 0.05, "the reference does not learn"
    for name in ("one_fp64", "two_fp64"):
        got = losses(exact_runs[name])
        diff = max(abs(a - b) for a, b in zip(got, want_losses))
        assert diff <= 1e-10, f"{name}: train/loss off by {diff:.2e}"
        weights = final_weights(exact_runs[name])
        for key, want in want_weights.items():
            assert weights[key].dtype == torch.float64, key
            err = (weights[key] - want).abs().max().item()
            assert err <= 1e-10, f"{name}: {key} off by {err:.2e}"


@pytest.mark.multiproc
def test_float32_trajectory_does_not_depend_on_the_split(exact_runs: dict[str, Path]) -> None:
    """1 process x micro 8 vs 2 ranks x micro 2 x accum 2 in float32: the same losses to 1e-5
    (and not trivially: the loss moves by far more than that)."""
    one, two = losses(exact_runs["one_fp32"]), losses(exact_runs["two_fp32"])
    assert max(abs(a - b) for a, b in zip(one, two)) <= 1e-5, (one, two)
    assert one[0] - one[-1] > 0.05


# --------------------------------------------------------------------------- resume, workers

NOISY = [
    "model.dropout=0.1",
    "data.noise=0.1",  # an augmentation drawn from torch's global generator in __getitem__
    "data.n_train=64",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    "train.max_steps=8",
    "train.log_every=1",
    "eval.every_steps=4",
    "eval.max_batches=2",
    "checkpoint.every_steps=2",
    "logger=none",
]


def kill_at(step: int, marker: Path) -> list[str]:
    return [
        "+callbacks.kill._target_=tests.ckpt_support.KillOnce",
        f"+callbacks.kill.step={step}",
        f"+callbacks.kill.marker={marker}",
    ]


@pytest.mark.launches
def test_sigkill_resume_is_bitwise_with_loader_workers(project: Path, tmp_path: Path) -> None:
    """Dropout plus a random augmentation, 2 loader workers: a run killed with SIGKILL after
    step 5 and rerun with the same command repeats steps 5-8 bit for bit. The same run
    without workers gives the same records too (the batches do not depend on them)."""
    marker = tmp_path / "killed"
    cmds = {
        "workers": trainer(project, tmp_path / "a", *NOISY, "data.num_workers=2"),
        "no_workers": trainer(project, tmp_path / "b", *NOISY, "data.num_workers=0"),
        "killed": trainer(
            project, tmp_path / "c", *NOISY, "data.num_workers=2", *kill_at(5, marker)
        ),
    }
    results = launch_all(cmds, TIMEOUT, PYTHONPATH=f"{project}:{REPO}")
    for name in ("workers", "no_workers"):
        assert results[name].returncode == 0, f"{name}\n{explain(results[name])}"
    assert results["killed"].returncode != 0 and marker.exists(), explain(results["killed"])
    rerun = launch(cmds["killed"], TIMEOUT, PYTHONPATH=f"{project}:{REPO}")
    assert rerun.returncode == 0, explain(rerun)

    def records(run: str) -> dict[int, dict[str, Any]]:
        keys = ("train/loss", "train/grad_norm", "val/loss", "val/accuracy")
        out: dict[int, dict[str, Any]] = {}
        for r in read_metrics(tmp_path / run):  # a redone step's last record wins
            out.setdefault(r["step"], {}).update({k: r[k] for k in keys if k in r})
        return out

    reference = records("a")
    assert sorted(reference) == list(range(1, 9))
    assert records("b") == reference, "the batches depend on data.num_workers"
    resumed = records("c")
    for step in range(5, 9):
        assert resumed[step] == reference[step], f"step {step} differs after kill -9 + rerun"
    assert "at step 4" in rerun.stdout, explain(rerun)  # resumed from the step-4 checkpoint
    lines = (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()
    trained = [r["step"] for r in map(json.loads, lines) if "train/loss" in r]
    assert trained == list(range(1, 9)), trained  # died in step 5, before its record


# --------------------------------------------------------------------------- FSDP


def test_fsdp_without_declared_blocks_names_the_key(project: Path) -> None:
    """The tagger declares no blocks: FSDP on 2 ranks is refused in one paragraph that names
    model.block_classes (checked where the run is assembled, before any process group)."""
    tagger = user_module(project)  # imported first: the config's check imports its targets
    cfg, _ = to_config(compose_config([*select(project), "dist.strategy=fsdp"]))
    spec, extras = split_extras(cfg.model, "model")
    model = tagger.Tagger()
    with pytest.raises(ConfigError, match=r"model\.block_classes.*dist\.strategy=fsdp") as err:
        parallelize(model, extras, build_parallelism("fsdp", DistInfo(rank=0, world_size=2)))
    assert "\n" not in str(err.value)
    del spec


@pytest.mark.multiproc
def test_fsdp_with_block_classes_follows_ddp(project: Path, tmp_path: Path) -> None:
    """`model.block_classes=[Linear]` shards a model that declares nothing: FSDP on 2 ranks
    gives DDP's losses to 1e-5."""
    common = [*EXACT, *TWO, "model.dtype=float32"]
    cmds = {
        "ddp": trainer(project, tmp_path / "ddp", *common, nproc=2),
        "fsdp": trainer(
            project,
            tmp_path / "fsdp",
            *common,
            "dist.strategy=fsdp",
            "model.block_classes=[Linear]",
            nproc=2,
        ),
    }
    results = launch_all(cmds, TIMEOUT, PYTHONPATH=str(project))
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
    ddp, fsdp = losses(tmp_path / "ddp"), losses(tmp_path / "fsdp")
    assert max(abs(a - b) for a, b in zip(ddp, fsdp)) <= 1e-5, (ddp, fsdp)


# --------------------------------------------------------------------------- bad input

BAD_PARTS = '''
import torch
from torch import nn
from torch.utils.data import IterableDataset


class TupleOutput(nn.Module):
    """Returns (logits, hidden): not something a built-in task can read."""

    def __init__(self, features=5, hidden=32, classes=4, dropout=0.0, dtype="float32"):
        super().__init__()
        self.proj = nn.Linear(features, classes)

    def forward(self, features):
        return self.proj(features), features


class Stream(IterableDataset):
    def __iter__(self):
        yield from ()


def streaming_data(**kwargs):
    return {"train": Stream(), "val": Stream()}
'''

BAD = {
    "target_does_not_import": (["model._target_=tagger.Nope"], "model._target_", "tagger.Nope"),
    "unknown_argument": (["model.hiden=8"], "model.hiden", "hidden"),
    "ill_typed_argument": (["model.hidden=wide"], "model.hidden", "an int"),
    "output_unreadable": (
        ["model._target_=bad_parts.TupleOutput", "task=classification"],
        "task",
        "logits",
    ),
    "not_map_style": (["data._target_=bad_parts.streaming_data"], "data._target_", "map-style"),
}


@pytest.mark.launches
@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_components_are_one_paragraph(
    case: tuple[list[str], str, str], project: Path, tmp_path: Path
) -> None:
    """Each is one paragraph naming the key and what is valid, a non-zero exit, no traceback,
    and no record or checkpoint written."""
    overrides, key, hint = case
    (tmp_path / "bad_parts.py").write_text(BAD_PARTS)
    run_dir = tmp_path / "run"
    cmd = trainer(project, run_dir, "logger=none", "train.max_steps=2", *overrides)
    proc = launch(cmd, TIMEOUT, PYTHONPATH=f"{project}:{tmp_path}")
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    error = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(error) == 1, explain(proc)
    assert key in error[0] and hint in error[0], explain(proc)
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
