"""The one launcher of every test that runs the trainer (or any module) in other processes.

`launch(cmd)` / `launch_all({name: cmd})` / `run_cli(args)` / `run_torchrun(n, args)` take the
command line a user would type: `[python, -m, trainer.train, ...]` or
`[python, -m, torch.distributed.run, --standalone, --nproc_per_node=N, -m, module, ...]`
(`torchrun_cmd`). Such a command runs *warm*: its ranks are forked from a zygote, a process
that has already imported torch, Hydra and the trainer (`trainer.train` and `trainer.evaluate`
and what they import, `torch._dynamo`, which torch's optimizers import in every run; a second
zygote, for launches that mention a Hugging Face model, also the transformers models the tests
build: `_HF_HINTS`), so a launch pays no imports (~3-6 s per rank on a loaded 2-core
machine, plus ~1.5 s for torchrun's agent). Each rank gets the environment torchrun
gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, the agent's TCP store on MASTER_PORT with
TORCHELASTIC_USE_AGENT_STORE, one TORCHELASTIC_RUN_ID...), its own stdout/stderr, and runs
the module with `runpy` as `python -m` would; Python's normal exit (atexit, thread joins)
ends it. Like torchrun's agent, the job's leader stops the other ranks (SIGTERM, then SIGKILL)
once one fails, exits 1 and prints torchrun's failure report (`failed (exitcode: 2) ...`,
`exitcode  : 2 (pid: ...)`); ranks' outputs come back concatenated, rank 0 first.

`real=True`, or a launcher flag the warm path does not emulate (`--max-restarts`, `--nnodes`,
`--no-python`...), runs the real process instead: keep that for tests of the launch itself
(torchrun restarts, rendezvous, the launcher's own behaviour) and a few end-to-end smoke
tests, and say why in the test's docstring. So does any other command (`python -c`, `bash`,
a console script) and an environment that Python or torch read at start-up (PYTHONHASHSEED,
OMP_*, TORCH*...): those cannot be changed after the zygote's imports. Tests of start-up
time or of what gets imported need a fresh interpreter: `real=True`.

Every launch has a deadline: past it, the job's whole process tree is killed and the test
fails, so a hang fails instead of stalling CI. The zygote starts on first use and is stopped
at the end of the session (`shutdown`, called by conftest).

What the warm path cannot reproduce: every rank shares the zygote's string-hash seed (fresh
interpreters get one each), and modules the zygote imported are already in `sys.modules`
(a run cannot show that it forgot to import one of them; import-time checks use fresh
`python -c` processes).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# torchrun's agent waits this long for the other workers after one failed before SIGKILL
# (its default is 30 s; workers here need ~1 s to leave a collective).
STOP_GRACE_S = 5.0
# Environment read while Python or torch start (torch reads many TORCH* settings when its
# modules are imported: TORCHINDUCTOR_COMPILE_THREADS, TORCH_LOGS...): a launch that changes
# one runs cold.
_STARTUP_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "LD_", "MALLOC", "GOMP_", "TORCH")
_STARTUP_ENV_OK = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"}
# Launcher flags the warm path reproduces; any other runs the real torchrun.
_WARM_FLAGS = ("--standalone",)
_TORCHRUN = ("-m", "torch.distributed.run")
# What the zygote imports (with everything they import): the commands tests run.
_ENTRY_POINTS = ("trainer.train", "trainer.evaluate")
# And what torch itself imports lazily in every run: torch.optim's first optimizer imports
# torch._dynamo (~1 s); the tensor- and context-parallel code, torch.distributed.tensor's
# experimental package (~0.2 s: it registers custom ops, reading their sources).
_TORCH_LAZY = ("torch._dynamo", "torch.distributed.tensor.experimental")
# The trainer imports transformers only for a Hugging Face model (a user's run without one
# never pays it); the suite launches ~40 ranks that build one, ~1.4 s of imports each on a
# quiet machine. Absent when the `hf` extra is not installed.
_OPTIONAL = (
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "peft",  # adapter=lora (the `adapter` extra): ~0.4 s after transformers
)
# So there are two zygotes: a launch whose arguments (or script) contain one of `_HF_HINTS`
# goes to the one that imported `_OPTIONAL` too; every other launch to one without them
# (~310 MiB and 2,400 modules instead of ~400 MiB and 3,800), whose ranks fork, run and exit
# faster (a one-process run of gpt_tiny: 0.89 -> 0.74 s of CPU). A launch sent to the lean
# one that needs transformers after all still runs: it imports it itself.
_HF_HINTS = ("hf", "lora", "chat", "pretrained", "llama", "gpt2", "peft", "transformers")
# And the run's own modules: the commands import them when a run starts, not at import (so
# that `--help` and a refused config stay fast); every rank would import them again. Every
# module of these packages but the commands themselves (`trainer.X`, run as __main__).
_PACKAGES = ("engine", "trainer")


# Called before every launch with (command, launches several ranks?); conftest sets it to
# fail a test whose markers do not say that it launches (`launches`, `multiproc`), so that
# `make test-fast` (`-m "not launches and not multiproc ..."`) really launches nothing.
launch_guard: Callable[[Sequence[str], bool], None] | None = None


# =========================================================================== commands


def env(**extra: str) -> dict[str, str]:
    """The environment of every launch: one OpenMP thread, quiet W&B, no API key."""
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    e.pop("WANDB_API_KEY", None)
    e.update(extra)
    return e


def python_cmd(module: str, *args: str) -> list[str]:
    """`python -m module args`."""
    return [sys.executable, "-m", module, *args]


def torchrun_cmd(nproc: int, *launcher_args: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node=N [launcher_args]`; append `-m module args`."""
    return [sys.executable, *_TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *launcher_args]


def torchrun(nproc: int, args: Sequence[str], module: str = "trainer.train") -> list[str]:
    """`torchrun --standalone --nproc_per_node=N -m module args`."""
    return [*torchrun_cmd(nproc), "-m", module, *args]


def explain(proc: subprocess.CompletedProcess) -> str:
    out, err = proc.stdout[-4000:], proc.stderr[-6000:]
    return f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


@dataclass(frozen=True)
class WarmPlan:
    """What a command runs, when the zygote can run it: `ranks` processes of `module` (or
    the script `script`) with `args`, under torchrun's environment when `torchrun`."""

    args: tuple[str, ...]
    module: str | None = None
    script: str | None = None
    ranks: int = 1
    torchrun: bool = False


def warm_plan(cmd: Sequence[str]) -> WarmPlan | None:
    """The warm equivalent of `cmd`, or None when only the real command will do."""
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if tuple(cmd[1:3]) == _TORCHRUN:
        rest, ranks = list(cmd[3:]), None
        while rest and rest[0].startswith("--"):
            flag = rest.pop(0)
            if flag.startswith("--nproc_per_node=") or flag.startswith("--nproc-per-node="):
                ranks = int(flag.split("=", 1)[1])
            elif flag not in _WARM_FLAGS:
                return None
        if ranks is None or "--standalone" not in cmd[3:] or rest[:1] != ["-m"] or len(rest) < 2:
            return None
        return WarmPlan(tuple(rest[2:]), module=rest[1], ranks=ranks, torchrun=True)
    if cmd[1] == "-m" and len(cmd) >= 3:
        return WarmPlan(tuple(cmd[3:]), module=cmd[2])
    if cmd[1].endswith(".py") and not cmd[1].startswith("-"):
        return WarmPlan(tuple(cmd[2:]), script=cmd[1])
    return None


def _needs_hf(plan: WarmPlan) -> bool:
    """Whether the launch goes to the zygote that imported transformers (`_HF_HINTS`)."""
    words = " ".join([plan.script or plan.module or "", *plan.args]).lower()
    return any(hint in words for hint in _HF_HINTS)


def _starts_ranks(cmd: Sequence[str]) -> bool:
    """Whether `cmd` is a torchrun launch (or a script that runs one)."""
    plan = warm_plan(cmd)
    if plan is not None:
        return plan.torchrun
    return any("torch.distributed.run" in c or "torchrun" in c for c in cmd)


def _startup_env_changed(environ: Mapping[str, str]) -> bool:
    base = env()
    keys = set(environ) | set(base)
    for k in keys:
        if environ.get(k) == base.get(k) or k in _STARTUP_ENV_OK:
            continue
        if k.startswith("PYTHON") or k.startswith(_STARTUP_ENV_PREFIXES):
            return True
    return False


# =========================================================================== launching


@dataclass
class Started:
    """A launched command: `wait` for it, `send_signal` to it (its ranks), `poll` it."""

    cmd: list[str]
    timeout: float
    started: float = field(default_factory=time.monotonic)
    proc: subprocess.Popen | None = None  # the real command
    job: _Job | None = None  # a warm one
    out: Any = None
    err: Any = None

    @property
    def warm(self) -> bool:
        return self.job is not None

    def poll(self) -> int | None:
        if self.job is not None:
            return self.job.poll()
        assert self.proc is not None
        return self.proc.poll()

    def pids(self) -> list[int]:
        """The pids of the processes running the module: a warm job's ranks, or the command's
        own pid (a real torchrun's agent, not its workers)."""
        if self.job is not None:
            return self.job.rank_pids()
        assert self.proc is not None
        return [self.proc.pid]

    def send_signal(self, sig: int) -> None:
        """To the process, or to every rank of a warm job (as torchrun forwards a signal)."""
        if self.job is not None:
            self.job.send_signal(sig)
        else:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def ended_by(self, deadline: float) -> bool:
        """Wait until the command ends (True) or the monotonic `deadline` passes (False)."""
        if self.job is not None:
            return self.job.wait(deadline)
        assert self.proc is not None
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True

    def collect(self) -> subprocess.CompletedProcess:
        """The result; a command still running is killed first (its whole tree)."""
        if self.job is not None:
            if self.job.poll() is None:
                self.job.kill()
            code, out, err = self.job.collect()
        else:
            assert self.proc is not None
            if self.proc.poll() is None:
                kill_tree(self.proc.pid)
                self.proc.wait()
            code, out, err = self.proc.returncode, _read(self.out), _read(self.err)
        return subprocess.CompletedProcess(self.cmd, code, out, err)

    def wait(self) -> subprocess.CompletedProcess:
        """The result; past the launch's timeout, kill the tree and fail the test."""
        ended = self.ended_by(self.started + self.timeout)
        result = self.collect()
        if not ended:
            _fail(self.timeout, {" ".join(self.cmd): result})
        return result


def _fail(timeout: float, late: dict[str, subprocess.CompletedProcess]) -> None:
    import pytest  # here: the zygote imports this module and must not import pytest

    pytest.fail(
        f"killed after {timeout:.0f} s (hang?):\n"
        + "\n".join(f"{cmd}\n{explain(proc)}" for cmd, proc in late.items())
    )


def _read(f: Any) -> str:
    f.seek(0)
    text = f.read()
    f.close()
    return text


def start(
    cmd: Sequence[str],
    timeout: float = 120.0,
    *,
    cwd: Path | None = None,
    real: bool = False,
    environ: Mapping[str, str] | None = None,
    **env_extra: str,
) -> Started:
    """Start `cmd` (warm when it can be, see the module docstring); output goes to files, so
    no pipe can fill up and block it. The environment is `env(**env_extra)`, or `environ`
    whole (to leave variables out)."""
    cmd = [str(c) for c in cmd]
    environ = dict(environ) if environ is not None else env(**env_extra)
    workdir = Path(cwd or REPO)
    if launch_guard is not None:
        launch_guard(cmd, _starts_ranks(cmd))
    plan = None if real or _startup_env_changed(environ) else warm_plan(cmd)
    handle = Started(cmd, timeout)
    if plan is not None:
        handle.job = _zygote(_needs_hf(plan)).submit(plan, environ, workdir)
        return handle
    handle.out = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by `collect`)
    handle.err = tempfile.TemporaryFile("w+")  # noqa: SIM115
    handle.proc = subprocess.Popen(
        cmd, stdout=handle.out, stderr=handle.err, text=True, cwd=workdir, env=environ
    )
    return handle


def launch(
    cmd: Sequence[str],
    timeout: float = 120.0,
    tmp: Path | None = None,
    *,
    cwd: Path | None = None,
    real: bool = False,
    environ: Mapping[str, str] | None = None,
    **env_extra: str,
) -> subprocess.CompletedProcess:
    """Run `cmd` from the repo root (or `cwd`); past `timeout` kill its tree and fail.
    `tmp` becomes TMPDIR (where a real torchrun leaves its `torchelastic_*` directories)."""
    if tmp is not None:
        env_extra = {"TMPDIR": str(tmp), **env_extra}
    return start(cmd, timeout, cwd=cwd, real=real, environ=environ, **env_extra).wait()


def launch_all(
    cmds: Mapping[str, Sequence[str]],
    timeout: float,
    cwd: Path | None = None,
    *,
    real: bool = False,
    **env_extra: str,
) -> dict[str, subprocess.CompletedProcess]:
    """Run independent commands at once; past `timeout` kill each unfinished one (its whole
    tree) and fail, naming every late one."""
    if launch_guard is not None:  # all checked before any starts: none is left running
        for cmd in cmds.values():
            launch_guard([str(c) for c in cmd], _starts_ranks([str(c) for c in cmd]))
    started = {n: start(c, timeout, cwd=cwd, real=real, **env_extra) for n, c in cmds.items()}
    deadline = time.monotonic() + timeout
    ended = {name: handle.ended_by(deadline) for name, handle in started.items()}
    results = {name: handle.collect() for name, handle in started.items()}
    if not all(ended.values()):
        _fail(timeout, {" ".join(cmds[n]): results[n] for n, ok in ended.items() if not ok})
    return results


def run_cli(
    args: Sequence[str],
    *,
    module: str = "trainer.train",
    timeout: float = 120,
    cwd: Path | None = None,
    environ: Mapping[str, str] | None = None,
    **env_extra: str,
) -> subprocess.CompletedProcess:
    """`python -m <module> args` as a user would type it."""
    return launch(python_cmd(module, *args), timeout, cwd=cwd, environ=environ, **env_extra)


def run_torchrun(
    nproc: int,
    args: Sequence[str],
    *,
    module: str = "trainer.train",
    timeout: float = 180,
    launcher_args: tuple[str, ...] = (),
    cwd: Path | None = None,
    real: bool = False,
    **env_extra: str,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N -m <module> args` (gloo on CPU)."""
    cmd = [*torchrun_cmd(nproc, *launcher_args), "-m", module, *args]
    return launch(cmd, timeout, cwd=cwd, real=real, **env_extra)


# =========================================================================== process trees


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc (Linux)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def descendants(pid: int) -> list[int]:
    """`pid` and everything below it, collected before any is killed (orphans get reparented)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(_children(p))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants: a timed-out torchrun must not leave workers behind."""
    for p in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


# =========================================================================== the client


class _Job:
    """A warm launch seen from the test: a socket to its leader and a folder of outputs."""

    def __init__(self, sock: socket.socket, folder: Path, ranks: int) -> None:
        self.sock = sock
        self.folder = folder
        self.ranks = ranks
        self.leader: int | None = None
        self.ranks_started: list[int] = []
        self.done: dict[str, Any] | None = None
        self._buf = b""

    def _pump(self, timeout: float) -> None:
        """Read the leader's messages for up to `timeout` seconds (or until it is done)."""
        end = time.monotonic() + timeout
        while self.done is None:
            left = end - time.monotonic()
            if not select.select([self.sock], [], [], max(0.0, left))[0]:
                return
            chunk = self.sock.recv(65536)
            if not chunk:  # the leader died without a word (killed)
                self.done = {"returncode": -signal.SIGKILL, "lost": True}
                return
            self._buf += chunk
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                msg = json.loads(line)
                if "leader" in msg:
                    self.leader = msg["leader"]
                    self.ranks_started = msg["ranks"]
                if "returncode" in msg:
                    self.done = msg
            if left <= 0:
                return

    def poll(self) -> int | None:
        self._pump(0.0)
        return None if self.done is None else self.done["returncode"]

    def wait(self, deadline: float) -> bool:
        """True once the job ended, False at the (monotonic) deadline."""
        while self.done is None and time.monotonic() < deadline:
            self._pump(min(1.0, deadline - time.monotonic()))
        return self.done is not None

    def rank_pids(self) -> list[int]:
        """The ranks' pids, in rank order (waits up to a minute for the leader to fork them)."""
        end = time.monotonic() + 60
        while self.leader is None and self.done is None and time.monotonic() < end:
            self._pump(min(1.0, end - time.monotonic()))
        return list(self.ranks_started)

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(json.dumps({"signal": int(sig)}).encode() + b"\n")

    def kill(self) -> None:
        """SIGKILL the job's processes (the ranks and all below them) and let the leader reap
        them and report, so no killed pid lingers as a zombie (a run-directory lock would
        still see it alive); if the leader itself does not answer, its whole group too."""
        self._pump(0.0)
        if self.leader is None or self.done is not None:
            self.done = self.done or {"returncode": -signal.SIGKILL, "killed": True}
            return
        for p in descendants(self.leader)[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        self.wait(time.monotonic() + 10)
        if self.done is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.leader, signal.SIGKILL)
            for p in descendants(self.leader):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            self.done = {"returncode": -signal.SIGKILL, "killed": True}

    def collect(self) -> tuple[int, str, str]:
        """(returncode, stdout, stderr): the ranks' outputs in rank order, the leader's report
        last, as torchrun's merged streams would hold them."""
        assert self.done is not None
        self.sock.close()

        def text(name: str) -> str:
            path = self.folder / name
            return path.read_text(errors="replace") if path.exists() else ""

        out = "".join(text(f"rank{r}.out") for r in range(self.ranks))
        err = "".join(text(f"rank{r}.err") for r in range(self.ranks)) + text("launcher.err")
        shutil.rmtree(self.folder, ignore_errors=True)
        return int(self.done["returncode"]), out, err


class _Zygote:
    """The client side of a zygote process (at most two per test session: `_HF_HINTS`)."""

    def __init__(self, hf: bool) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="cumulus-ranks-"))
        self.sock_path = str(self.root / "zygote.sock")
        self.log = (self.root / "zygote.log").open("w+")
        serve = ["serve", self.sock_path, *(["hf"] if hf else [])]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ranks", *serve],
            cwd=REPO,
            env=env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        ready = select.select([self.proc.stdout], [], [], 120)[0]
        line = self.proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.stop()
            self.log.seek(0)
            raise RuntimeError(f"the warm launcher did not start:\n{self.log.read()[-4000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def submit(self, plan: WarmPlan, environ: dict[str, str], cwd: Path) -> _Job:
        folder = Path(tempfile.mkdtemp(prefix="job-", dir=self.root))
        request = {
            "module": plan.module,
            "script": plan.script,
            "args": list(plan.args),
            "ranks": plan.ranks,
            "torchrun": plan.torchrun,
            "env": environ,
            "cwd": str(cwd),
            "folder": str(folder),
        }
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.sock_path)
        sock.sendall(json.dumps(request).encode() + b"\n")
        return _Job(sock, folder, plan.ranks)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


_ZYGOTES: dict[bool, _Zygote] = {}  # by whether it imported transformers


def _zygote(hf: bool = False) -> _Zygote:
    zygote = _ZYGOTES.get(hf)
    if zygote is None or not zygote.alive():
        zygote = _ZYGOTES[hf] = _Zygote(hf)
    return zygote


def shutdown() -> None:
    """Stop the zygotes (end of the test session)."""
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].stop()


atexit.register(shutdown)


# =========================================================================== the zygote


@dataclass
class _Rank:
    """What a forked rank runs once it has left the zygote's and leader's frames."""

    request: dict[str, Any]
    rank: int
    extra_env: dict[str, str]


def _warm_hydra() -> None:
    """Compose a config once, as the commands do: Hydra's and OmegaConf's parsers build their
    lexer and parser caches on first use, ~0.1 s that every rank would pay again. Nothing of
    the composition is kept (the global Hydra is cleared)."""
    from hydra.core.global_hydra import GlobalHydra

    from trainer.config.cli import compose_train

    compose_train(["model=gpt_tiny", "train.max_steps=1"])
    GlobalHydra.instance().clear()


def _run_modules() -> list[str]:
    """The modules of `_PACKAGES`, less the command modules directly under `trainer`."""
    import importlib
    import pkgutil

    names = []
    for package in _PACKAGES:
        path = importlib.import_module(package).__path__
        for info in pkgutil.walk_packages(path, prefix=f"{package}."):
            command = package == "trainer" and not info.ispkg and info.name.count(".") == 1
            if not command:
                names.append(info.name)
    return names


def _serve(sock_path: str, hf: bool) -> _Rank:
    """Import what every run imports (and `_OPTIONAL` where `hf`), then fork one job leader
    per request. Returns only in a rank process, with what it must run."""
    import importlib

    for name in (*_ENTRY_POINTS, *_TORCH_LAZY):
        importlib.import_module(name)
    for name in (*(_OPTIONAL if hf else ()), *_run_modules()):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    _warm_hydra()
    # `python -m trainer.train` runs the module as __main__ only: forget the entry points
    # themselves (keeping all they imported), or runpy would warn and run a second copy.
    for entry in _ENTRY_POINTS:
        del sys.modules[entry]
        package, _, name = entry.rpartition(".")
        with contextlib.suppress(AttributeError):
            delattr(sys.modules[package], name)

    # The imports registered ~180 operator libraries, each with an exit-time finalizer that
    # takes its kernels out of the dispatcher one by one (5% of py-spy's samples of a
    # one-process launch, in pages the rank must copy first): nothing a process about to
    # vanish needs. A fresh process runs them.
    for ref, info in list(weakref.finalize._registry.items()):  # type: ignore[attr-defined]
        if getattr(info.func, "__module__", "") == "torch.library":
            ref.atexit = False
    # What was imported stays until exit in a fresh process too: out of the collector's
    # sight, a child's collections and its exit do not touch (and copy) the zygote's pages
    # (a `python -m trainer.compare` took 1.5 s to exit without this, 0.3 s with it).
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    listener.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # leaders are reaped by the kernel
    _become_subreaper()
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test session is gone
                os._exit(0)
            continue
        conn.settimeout(30)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
        if not buf.endswith(b"\n"):
            conn.close()
            continue
        request = json.loads(buf)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return _lead(request, conn)
        conn.close()


def _become_subreaper() -> None:
    """Orphans of a job (the ranks of a leader killed on a timeout, their data workers) are
    re-parented to the zygote, which reaps them (SIGCHLD ignored), instead of to PID 1: in
    containers PID 1 may never reap them, and a zombie's pid looks alive (to a run lock)."""
    import ctypes

    pr_set_child_subreaper = 36
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def _lead(request: dict[str, Any], conn: socket.socket) -> _Rank:
    """The job's leader, torchrun's agent in short: fork the ranks, host the store, wait,
    stop the others when one fails, report. Returns only in a rank process."""
    try:
        os.setpgid(0, 0)  # the job is one process group: a timeout kills it whole
        folder = Path(request["folder"])
        # The leader's own words (its report) go to launcher.err; not to the zygote's stdout,
        # a pipe the test session no longer reads.
        log = os.open(folder / "launcher.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        ranks, torchrun = int(request["ranks"]), bool(request["torchrun"])
        store_sock, extra = None, {}
        if torchrun:
            store_sock = socket.socket()
            store_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            store_sock.bind(("127.0.0.1", 0))
            store_sock.listen(128)
            port = store_sock.getsockname()[1]
            extra = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "ROLE_WORLD_SIZE": str(ranks),
                "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1",
                "ROLE_NAME": "default",
                "TORCHELASTIC_RUN_ID": str(uuid.uuid4()),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            }
        pids: dict[int, int] = {}
        for rank in range(ranks):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                conn.close()
                if store_sock is not None:
                    store_sock.close()
                return _Rank(request, rank, extra)
            pids[pid] = rank
        store = None
        if store_sock is not None:
            import datetime

            import torch.distributed as dist

            store = dist.TCPStore(
                "127.0.0.1",
                store_sock.getsockname()[1],
                ranks,
                is_master=True,
                timeout=datetime.timedelta(seconds=900),
                wait_for_workers=False,
                master_listen_fd=store_sock.fileno(),
            )
        started = {"leader": os.getpid(), "ranks": sorted(pids, key=pids.__getitem__)}
        conn.sendall(json.dumps(started).encode() + b"\n")
        code = _watch(pids, conn, torchrun, request)
        del store
        conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
    except BaseException:
        traceback.print_exc()
        os._exit(70)
    os._exit(0)


def _watch(pids: dict[int, int], conn: socket.socket, torchrun: bool, request: dict) -> int:
    """Wait for the ranks like torchrun's agent: the first failure stops the others."""
    exits: dict[int, tuple[int, int, float]] = {}  # rank: (exit code, pid, time)
    first: int | None = None
    kill_at: float | None = None
    conn.setblocking(False)
    buf = b""
    while len(exits) < len(pids):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid not in pids:
                continue
            rank, code = pids[pid], os.waitstatus_to_exitcode(status)
            exits[rank] = (code, pid, time.time())
            if code != 0 and first is None:
                first = rank
                for other, r in pids.items():
                    if r not in exits:
                        print(
                            f"[warm launcher] Sending process {other} closing signal SIGTERM",
                            file=sys.stderr,
                            flush=True,
                        )
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(other, signal.SIGTERM)
                kill_at = time.monotonic() + STOP_GRACE_S
        if len(exits) == len(pids):
            break
        if kill_at is not None and time.monotonic() > kill_at:
            for other, r in pids.items():
                if r not in exits:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGKILL)
            kill_at = None
        if select.select([conn], [], [], 0.02)[0]:
            chunk = conn.recv(4096)
            if not chunk:  # the test is gone: so is the job
                os.killpg(0, signal.SIGKILL)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                sig = json.loads(line)["signal"]
                for other, r in pids.items():
                    if r not in exits:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(other, sig)
    conn.setblocking(True)
    if not torchrun:
        return exits[0][0]
    if first is None:
        return 0
    _report(exits, first, request)
    return 1


def _report(exits: dict[int, tuple[int, int, float]], first: int, request: dict) -> None:
    """torchrun's failure report, in its words (tests read the workers' exit codes in it)."""
    what = request["module"] or request["script"]
    code, pid, _ = exits[first]
    print(
        f"[warm launcher] failed (exitcode: {code}) local_rank: {first} (pid: {pid}) of {what}",
        file=sys.stderr,
    )

    def entry(i: int, rank: int) -> str:
        code, pid, when = exits[rank]
        sig = f"  ({signal.Signals(-code).name})" if code < 0 else ""
        return (
            f"[{i}]:\n  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(when))}\n"
            f"  host      : localhost\n  rank      : {rank} (local_rank: {rank})\n"
            f"  exitcode  : {code} (pid: {pid}){sig}\n"
        )

    others = [r for r in sorted(exits) if r != first and exits[r][0] != 0]
    bar = "=" * 60
    lines = [bar, f"{what} FAILED (warm launcher)", "-" * 60, "Failures:"]
    lines += [entry(i + 1, r) for i, r in enumerate(others)] or ["  <NO_OTHER_FAILURES>"]
    lines += ["-" * 60, "Root Cause (first observed failure):", entry(0, first), bar]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _become(job: _Rank) -> None:
    """Turn this forked process into `python -m module args` (or `python script args`) of
    rank `job.rank`, then run it; exceptions and SystemExit end the interpreter as usual."""
    import importlib
    import runpy

    req = job.request
    folder = Path(req["folder"])
    environ = dict(req["env"])
    if req["torchrun"]:
        environ.update(job.extra_env)
        environ.update(RANK=str(job.rank), LOCAL_RANK=str(job.rank), ROLE_RANK=str(job.rank))
        environ["TORCHELASTIC_ERROR_FILE"] = str(folder / f"rank{job.rank}.error.json")
    ours = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(req["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, name in ((1, f"rank{job.rank}.out"), (2, f"rank{job.rank}.err")):
        f = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # sys.path as a fresh `python -m` (or `python script`) here would have it.
    theirs = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in ours]
    script = req["script"]
    first = str(Path(script).resolve().parent) if script else os.getcwd()
    sys.path[:] = [first, *[str(Path(p).resolve()) for p in theirs], *rest]
    importlib.invalidate_caches()
    tempfile.tempdir = None  # TMPDIR may have changed
    if "numpy" in sys.modules:  # a fresh interpreter's global NumPy state is its own
        sys.modules["numpy"].random.seed()
    if script:
        sys.argv = [script, *req["args"]]
        runpy.run_path(script, run_name="__main__")
    else:
        sys.argv = [req["module"], *req["args"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _become(_serve(sys.argv[2], hf=sys.argv[3:4] == ["hf"]))
