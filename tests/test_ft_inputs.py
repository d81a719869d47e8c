"""`ft=torchft`'s bad input, each one paragraph naming the key within `ft.timeout_s`, and its
commands (docs/guides/fault-tolerance.md). Decided from the config in this process where it can be;
launched where the lighthouse, or its loss, is the input."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import complete_train_lines, compose_config, read_metrics, stdlib_text
from tests.ranks import explain
from trainer.config.cli import to_config
from trainer.config.errors import ConfigError, UserError

os.environ.setdefault("RUST_LOG", "warn")  # torchft's own log of every quorum: off
FT = ["ft=torchft", "ft.lighthouse=http://127.0.0.1:29510"]
TRACEBACK = "Traceback (most recent call last)"


def config(*overrides: str) -> Any:
    cfg, _ = to_config(compose_config(["model=gpt_tiny", "logger=none", *overrides]))
    return cfg


def refusal(*overrides: str) -> ConfigError:
    """The refusal the compatibility table gives these overrides from the config (lifecycle's
    check, before any process group)."""
    from trainer.run.lifecycle import check_choices

    with pytest.raises(ConfigError) as err:
        check_choices(config(*FT, *overrides))
    return err.value


# --------------------------------------------------------------------------- in this process


def test_min_groups_above_groups_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"ft\.min_groups.*from 1 to ft\.groups \(2\)"):
        config(*FT, "ft.groups=2", "ft.min_groups=3")


def test_a_group_id_outside_the_groups_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"ft\.group.*0 \.\. 1"):
        config(*FT, "ft.groups=2", "ft.group=2")


def test_no_lighthouse_address_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=r"ft\.lighthouse.*trainer\.lighthouse"):
        config("ft=torchft")


def test_ft_without_the_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name)
    )
    with pytest.raises(ConfigError, match=r"`ft`: ft=torchft needs torchft.*\[ft\]"):
        config(*FT)


def test_torchft_environment_overrides_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft's TORCHFT_*_SEC variables would silently win over ft.timeout_s."""
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "5")
    with pytest.raises(ConfigError, match=r"ft\.timeout_s.*TORCHFT_QUORUM_TIMEOUT_SEC=5"):
        config(*FT)


def test_a_batch_the_live_groups_cannot_split_is_refused() -> None:
    """Every number of live groups from ft.min_groups on must split the step's micro-batches
    evenly: 8 micro-batches go 1, 2 or 4 ways, not 3."""
    from trainer.run.ft import job_plan

    cfg = config(*FT, "ft.groups=3", "train.micro_batch_size=2", "train.global_batch_size=16")
    with pytest.raises(ConfigError, match=r"train\.global_batch_size.*multiples of 12"):
        job_plan(cfg.train, cfg.ft, group_dp=1)
    cfg = config(*FT, "ft.groups=3", "ft.min_groups=3", "train.micro_batch_size=2")
    assert job_plan(cfg.train, cfg.ft, 1).dp_size == 3  # 3 ranks x 2 x accum 2: only 3 ways


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("dist.tp=2",), "dist.tp"),
        (("dist.pp=2",), "dist.pp"),
        (("dist.cp=2",), "dist.cp"),
        (("dist.ep=2", "model.moe.experts=4"), "dist.ep"),
        (("train.micro_batch_size=auto", "train.global_batch_size=16"), "train.micro_batch_size"),
        (("step=sam",), "step"),
        (("callbacks=noise_scale",), "callbacks.noise_scale"),
    ],
    ids=["tp", "pp", "cp", "ep", "auto", "sam", "per_micro_batch"],
)
def test_what_ft_does_not_compose_with_is_refused(overrides: tuple[str, ...], key: str) -> None:
    err = refusal(*overrides)
    assert err.key == key and "ft=torchft" in str(err), str(err)


def test_a_second_launch_of_one_group_is_refused(tmp_path: Path) -> None:
    """Each group holds its own lock of the shared run directory: a second launch with the
    same ft.group is refused naming it; another group's launch is not."""
    from engine.distributed import DistInfo
    from trainer.run.lifecycle import group_lock
    from trainer.run.lock import RunDirInUse

    one, other = config(*FT, "ft.groups=2"), config(*FT, "ft.groups=2", "ft.group=1")
    taken = r"ft\.group.*replica group 0 .*running already"
    with (
        group_lock(tmp_path, DistInfo(), one),
        group_lock(tmp_path, DistInfo(), other),
        pytest.raises(RunDirInUse, match=taken),
        group_lock(tmp_path, DistInfo(), one),
    ):
        pass


def test_lighthouse_help_lists_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.lighthouse import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--min-groups", "--port", "--bind", "--join-timeout-s", "--heartbeat-timeout"):
        assert option in out, out


def test_an_unreachable_lighthouse_fails_within_the_timeout() -> None:
    """Nothing listens: torchft's connect gives up within half of ft.timeout_s."""
    pytest.importorskip("torchft")
    from engine.distributed import DistInfo
    from engine.parallel.replicas import QuorumFailed, ReplicaGroups, ReplicaSettings

    settings = ReplicaSettings("http://127.0.0.1:1", 0, 2, timeout_s=2.0)
    replicas = ReplicaGroups(settings, DistInfo(), save=dict, load=lambda state: None)
    began = time.monotonic()
    with pytest.raises(QuorumFailed, match=r"(?i)connect"):
        replicas.connect()
    assert time.monotonic() - began < settings.timeout_s + 1.0


# --------------------------------------------------------------------------- launched


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stdlib_text(tmp_path_factory.mktemp("ft_text") / "text.txt", 40_000)


def train_cmd(run_dir: Path, text: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer.train",
        "model=gpt_tiny",
        "logger=none",
        f"data.path={text}",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.log_every=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        f"hydra.run.dir={run_dir}",
        "ft=torchft",
        *overrides,
    ]


def lighthouse() -> tuple[Any, str]:
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000
    )
    return server, "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]


def assert_one_paragraph(proc: subprocess.CompletedProcess, key: str) -> str:
    assert proc.returncode == 2, explain(proc)
    assert TRACEBACK not in proc.stderr + proc.stdout, explain(proc)
    line = next((ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")), "")
    assert f"`{key}`" in line, explain(proc)
    return line


@pytest.mark.launches
def test_unreachable_lighthouse_is_one_paragraph(tmp_path: Path, text: Path) -> None:
    from tests import ranks

    cmd = train_cmd(tmp_path / "run", text, "ft.lighthouse=http://127.0.0.1:1", "ft.timeout_s=3")
    began = time.monotonic()
    proc = ranks.launch(cmd, timeout=120)
    line = assert_one_paragraph(proc, "ft.lighthouse")
    assert "127.0.0.1:1" in line and "python -m trainer.lighthouse" in line
    assert time.monotonic() - began < 60  # the connect gave up after 1.5 s (start-up aside)


@pytest.mark.multiproc
def test_two_groups_with_one_id_are_refused(tmp_path: Path, text: Path) -> None:
    """Two launches claiming group 0 (different run directories: no lock can tell) meet in
    the first step's count: each stops with one paragraph naming ft.group."""
    from tests import ranks

    server, address = lighthouse()
    try:
        cmds = {
            name: train_cmd(
                tmp_path / name,
                text,
                f"ft.lighthouse={address}",
                "ft.groups=2",
                "ft.group=0",
                "ft.timeout_s=20",
            )
            for name in ("a", "b")
        }
        procs = ranks.launch_all(cmds, timeout=180)
    finally:
        server.shutdown()
    for proc in procs.values():
        assert "claimed by 2 groups" in assert_one_paragraph(proc, "ft.group")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.launches
def test_a_lost_lighthouse_stops_the_group_after_saving(tmp_path: Path, text: Path) -> None:
    """The lighthouse (`python -m trainer.lighthouse`) is killed mid-run: the group stops
    after ft.timeout_s with one paragraph naming ft.lighthouse, the last committed step saved
    first, every record up to it kept."""
    from tests import ranks

    port = free_port()
    lighthouse = ranks.start(
        ranks.python_cmd("trainer.lighthouse", "--port", str(port), "--bind", "127.0.0.1"),
        timeout=240,
    )
    run_dir = tmp_path / "run"
    try:
        deadline = time.monotonic() + 120
        while not listening(port) and time.monotonic() < deadline:
            assert lighthouse.poll() is None, explain(lighthouse.collect())
            time.sleep(0.2)
        cmd = train_cmd(
            run_dir,
            text,
            f"ft.lighthouse=http://127.0.0.1:{port}",
            "ft.groups=1",
            "ft.timeout_s=3",
            "train.max_steps=500",
            "+callbacks.slow._target_=tests.ft_support.Slowdown",
            "+callbacks.slow.seconds=0.05",
        )
        group = ranks.start(cmd, timeout=180)
        while complete_train_lines(run_dir / "metrics.jsonl") < 5 and time.monotonic() < deadline:
            assert group.poll() is None, explain(group.collect())
            time.sleep(0.2)
        lighthouse.send_signal(signal.SIGKILL)
        stopped = time.monotonic()
        proc = group.wait()
    finally:
        lighthouse.collect()
    assert time.monotonic() - stopped < 3 + 20  # ft.timeout_s, then the save and the exit
    line = assert_one_paragraph(proc, "ft.lighthouse")
    steps = [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert steps == list(range(1, steps[-1] + 1)), steps
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == [f"step_{steps[-1]:08d}"], (saved, steps[-1])
    assert f"Step {steps[-1]} is saved" in line, line


def test_user_error_is_what_the_lighthouse_loss_raises() -> None:
    from trainer.run.fit import RunEnded
    from trainer.run.ft import LighthouseLost

    assert issubclass(LighthouseLost, UserError) and issubclass(LighthouseLost, RunEnded)


class Payload:
    """What a hostile peer could send: unpickling it would run a command."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo pwned > /dev/null",))


def test_a_peers_state_is_read_as_tensors_and_plain_values_only() -> None:
    """The state a group behind takes from a peer is read with weights_only=True (torchft's
    own HTTP transport unpickles anything): a state of tensors, RNG and plain values arrives
    bitwise; one holding any other object is refused before anything in it runs."""
    pytest.importorskip("torchft")
    import pickle
    from datetime import timedelta

    import torch

    from engine.parallel.replicas import weights_only_transport
    from engine.rng import rng_state

    timeout = timedelta(seconds=10)
    peer, behind = weights_only_transport(timeout), weights_only_transport(timeout)
    try:
        state = {"w": torch.randn(3, 2), "rng": rng_state(), "step": 7, "lr": [0.1, (0.9, 0.95)]}
        peer.send_checkpoint([1], step=7, state_dict=state, timeout=timeout)
        got = behind.recv_checkpoint(0, peer.metadata(), step=7, timeout=timeout)
        assert torch.equal(got["w"], state["w"]) and got["step"] == 7 and got["lr"] == state["lr"]
        peer.disallow_checkpoint()
        peer.send_checkpoint([1], step=8, state_dict={"payload": Payload()}, timeout=timeout)
        with pytest.raises(pickle.UnpicklingError, match=r"GLOBAL posix\.system"):
            behind.recv_checkpoint(0, peer.metadata(), step=8, timeout=timeout)
    finally:
        peer.shutdown(wait=False)
        behind.shutdown(wait=False)
