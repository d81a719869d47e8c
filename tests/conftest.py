"""Shared helpers: compose the real config, run the real trainer in-process, read its records.

Launching the trainer in other processes (one or several ranks) is `tests/ranks.py`'s job."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from engine.distributed import DistInfo
from tests import ranks
from trainer.config.cli import to_config
from trainer.config.schema import register_configs
from trainer.config.signing import ENV
from trainer.config.trust import derived_keys
from trainer.run.identity import register_resolvers

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "configs"
# Fast, quiet defaults for tests; each test adds its own overrides after these.
TINY = [
    "model=gpt_tiny",
    "logger=none",
    "train.micro_batch_size=8",
    "train.grad_accum_steps=2",
    "train.max_steps=10",
    "train.log_every=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "scheduler.warmup_steps=2",
]

# This session's own checkpoint secret (trainer/config/signing.py), never the user's
# ~/.config: the runs it trains are "own" to the evaluations it launches, which inherit it.
SIGNING_DIR = tempfile.mkdtemp(prefix="cumulus-config-")
os.environ[ENV] = SIGNING_DIR
atexit.register(shutil.rmtree, SIGNING_DIR, True)

register_configs()
register_resolvers()
# In-process runs share 2 cores with the subprocesses tests launch; threads only contend.
torch.set_num_threads(1)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread (as OMP_NUM_THREADS=1 gives the subprocesses); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def stdlib_text(path: Path, n_bytes: int) -> Path:
    """The first `n_bytes` of the stdlib sources as one text file at `path`: real text that
    loads in milliseconds (all of `data.path=stdlib` takes seconds per launch)."""
    blob = b""
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        blob += source.read_bytes()
        if len(blob) >= n_bytes:
            break
    path.write_bytes(blob[:n_bytes])
    return path


def compose_config(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("train", overrides=overrides)


def in_tree_model(name: str) -> dict[str, Any]:
    """configs/model/NAME.yaml as a plain mapping, its `${random_init:V}` defaults read as V
    (what the model is built with at random init)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.load(CONFIG_DIR / "model" / f"{name}.yaml")
    node = OmegaConf.to_container(raw, resolve=True)
    assert isinstance(node, dict)
    return node  # type: ignore[return-value]


def train_in_process(overrides: list[str], run_dir: Path) -> list[dict[str, Any]]:
    """Run the real trainer in this process (one rank) and return its metrics records."""
    from trainer.run.lifecycle import check_choices, train

    composed = compose_config(overrides)
    cfg, plain = to_config(composed)
    check_choices(cfg)  # as the entry points do, before they join a process group
    train(cfg, plain, DistInfo(), run_dir, derived_keys(composed))
    return read_metrics(run_dir)


def rewrite_state(src: Path, dst: Path, change: Any) -> Path:
    """A copy of checkpoint `src` at `dst` whose `state.pt` `change` rewrote in place, with a
    manifest consistent with its files (as a careful attacker would leave it)."""
    import hashlib

    shutil.copytree(src, dst)
    state = torch.load(dst / "state.pt", weights_only=True)
    change(state)
    torch.save(state, dst / "state.pt")
    manifest = json.loads((dst / "manifest.json").read_text())
    data = (dst / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def received(src: Path, dst: Path) -> Path:
    """Checkpoint `src` as another user or machine hands it over: the same files, its config
    signed with their secret (trainer/config/signing.py), not this session's."""
    import secrets

    from trainer.config.signing import digest
    from trainer.run.state import DERIVED, SIGNATURE, signed_config

    def sign_elsewhere(state: dict[str, Any]) -> None:
        record = signed_config(state["config"], state[DERIVED])
        state[SIGNATURE] = digest(record, secrets.token_bytes(32))

    return rewrite_state(src, dst, sign_elsewhere)


def strict_json(line: str) -> Any:
    """`json.loads` as strict parsers (jq, JavaScript) read: NaN and Infinity are errors."""

    def reject(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON: {line[:200]}")

    return json.loads(line, parse_constant=reject)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of `metrics.jsonl`, each line parsed as strict JSON."""
    path = Path(run_dir) / "metrics.jsonl"
    return [strict_json(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "train/loss" in r]


def complete_train_lines(path: Path) -> int:
    """Training records in a metrics.jsonl that another process is writing: a line without
    its newline yet is not counted (it may be half-written). Wait on this, not on the file
    being there."""
    if not path.exists():
        return 0
    lines = path.read_text().split("\n")[:-1]
    return sum('"train/loss"' in line for line in lines)


@pytest.fixture
def tiny() -> list[str]:
    return list(TINY)


@pytest.fixture(scope="session", autouse=True)
def warm_launcher() -> Iterator[None]:
    """The warm launcher's zygote (started by the first launch) ends with the session."""
    yield
    ranks.shutdown()


_RUNNING: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _RUNNING.append(item)
    try:
        return (yield)
    finally:
        _RUNNING.pop()


def _check_launch(cmd: Sequence[str], several_ranks: bool) -> None:
    """Every launch comes from a test marked for it (also when a fixture it uses launches):
    `launches` for one process, `multiproc` for several ranks. The fast tier deselects both,
    so a missing mark would slip slow work into it; this makes it an error instead."""
    if not _RUNNING:
        return
    item = _RUNNING[-1]
    marks = {m.name for m in item.iter_markers()}
    need = "multiproc" if several_ranks else "launches"
    if need not in marks and "multiproc" not in marks:
        pytest.fail(
            f"{item.nodeid} (or a fixture it uses) launches {' '.join(cmd[:8])} ... but is not "
            f"marked `{need}`: add @pytest.mark.{need} (see docs/testing.md)",
            pytrace=False,
        )


ranks.launch_guard = _check_launch


# The files that take longest (worker-seconds of a full run), run first: pytest-xdist's
# `--dist loadfile` deals files to its workers in collection order as they free up, so a long
# file dealt last would leave the other worker idle at the end. Measured with --durations
# (make test prints the slowest); the order only schedules, it changes no test.
LONGEST_FIRST = (
    "test_checkpoint.py",
    "test_certify.py",
    "test_dpo.py",
    "test_corpus.py",
    "test_distributed.py",
    "test_plan.py",
    "test_ft.py",
    "test_steps.py",
    "test_auto_micro_batch.py",
    "test_grpo_run.py",
    "test_tensor_parallel.py",
    "test_tokenizers.py",
    "test_hf.py",
    "test_expert_parallel.py",
    "test_expert_parallel_hf.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (`LONGEST_FIRST`), each file's tests kept together and in
    order (its module fixtures run once), the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--check-marks",
        action="store_true",
        help="check every launch against the test's markers, in suite order, without "
        "launching anything (the launching tests are skipped): about a minute",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--check-marks"):
        ranks.launch_guard = _check_then_skip


def _check_then_skip(cmd: Sequence[str], several_ranks: bool) -> None:
    _check_launch(cmd, several_ranks)
    pytest.skip("--check-marks: launches are checked, not run")


def compile_and_record(
    model: Any, task: Any, batches: list[Any], precision: Any
) -> tuple[list[Any], list[float], dict[str, int], dict[str, int]]:
    """`model.compile` with a backend that records dynamo's graphs and runs them as traced
    (what inductor would compile, without its minute of compiling), then each batch's
    `task.loss_sum` under `precision`'s autocast and its backward: (graphs, losses, graph
    breaks, frames) as dynamo counted them. Dynamo is reset before and after."""
    import torch._dynamo

    graphs: list[Any] = []

    def record(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        model.compile(backend=record)
        got = []
        for b in batches:  # the step's micro-batches
            with precision.autocast():
                loss = task.loss_sum(model, b)
            loss.backward()
            got.append(loss.item())
        breaks, frames = dict(counters["graph_break"]), dict(counters["frames"])
    finally:
        torch._dynamo.reset()
    return graphs, got, breaks, frames
