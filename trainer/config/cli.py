"""What every command does around its work: validate the config, join the process group, turn
errors into one paragraph and an exit code."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import gc
import os
import signal
import sys
import time
import traceback
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import omegaconf
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config.errors import ConfigError, UserError
from trainer.config.pretrained import keep_directory_values, register_random_init
from trainer.config.schema import OFF_AT_ZERO, Config, off_at_zero

if TYPE_CHECKING:
    from engine.distributed import DistInfo

T = TypeVar("T")
EXIT_USER_ERROR = 2


@functools.cache
def schema_hints(schema: type) -> dict[str, Any]:
    """The schema dataclass's field types. Cached: with postponed annotations every call
    evaluates each annotation's string again, and the config checks ask per key (a tenth
    of a second per command start, per rank)."""
    return typing.get_type_hints(schema)


def unknown_key(parts: list[str], schema: type = Config) -> ConfigError | None:
    """The error for dotted key `parts` if the schema has no such key; None if it has (or the
    key lies under a free-form node such as `step` or `callbacks`)."""
    for i, part in enumerate(parts):
        hints = schema_hints(schema)
        names = [f.name for f in dataclasses.fields(schema)]
        if part not in names:
            key = ".".join(parts[: i + 1])
            where = ".".join(parts[:i]) or "the root config"
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"Did you mean `{'.'.join([*parts[:i], close[0]])}`? " if close else ""
            return ConfigError(
                key, f"unknown key. {hint}Valid keys of {where}: {', '.join(sorted(names))}."
            )
        if not dataclasses.is_dataclass(hints[part]):
            return None
        schema = hints[part]
    return None


def check_overrides(args: list[str], config_dir: Path) -> None:
    """Reject command-line overrides of unknown keys before Hydra composes, in one paragraph
    that lists the valid keys (Hydra's own message does not, and `+key=` would pass)."""
    sweep = any(a in ("-m", "--multirun") for a in args)
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        parts = key.split(".")
        if len(parts) == 1 and (config_dir / key).is_dir() and not arg.startswith("~"):
            check_selection(key, value, config_dir, args)
            continue  # a config group choice such as model=gpt_tiny
        if parts[0] == "hydra":
            continue  # Hydra's own settings
        if parts[:2] == ["logger", "trackers"] and len(parts) > 2 and not arg.startswith("+"):
            raise ConfigError(
                key,
                "trackers are chosen by selecting their configs: logger=[wandb,tensorboard,"
                "mlflow] (any of them), or logger=none",
            )
        error = unknown_key(parts)
        if error is not None:
            raise error
        if not sweep and not any(c in value for c in ",($"):  # sweeps, functions, ${...}
            check_value_type(key, value)


def compose_train(overrides: list[str]) -> DictConfig:
    """The DictConfig that `python -m trainer.train OVERRIDES` composes, after the command
    line's one-paragraph checks of the overrides: what `trainer.plan`, `trainer.preview` and
    `trainer.api` start from."""
    from hydra import compose, initialize_config_dir

    from trainer.config.schema import CONFIG_DIR, register_configs
    from trainer.run.identity import register_resolvers

    register_configs()
    register_resolvers()
    check_overrides(overrides, CONFIG_DIR)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("train", overrides=overrides)


# Command-line arguments that can bring a config this repository does not ship (or set
# `hydra.mode` itself): with one of them, Hydra reads the run mode from the composed config.
_MAY_SET_MODE = ("hydra.mode", "hydra.searchpath", "-cp", "--config-path", "-cn")
_MAY_SET_MODE += ("--config-name", "-cd", "--config-dir")


def compose_once(args: list[str]) -> None:
    """Let `@hydra.main` compose the config once, not twice. Before the run's own compose,
    Hydra composes the whole config a first time only to read `hydra.mode` (a config file may
    ask for a multirun); unset, the command line decides (`-m`). No config shipped here sets
    it (tests/test_config.py checks), so unless the command line can bring one that does, the
    first compose is skipped: ~0.15 s of CPU per rank (a quarter of a warm rank's start),
    more on a loaded node."""
    from hydra._internal.hydra import Hydra

    if any(a.lstrip("+~").startswith(_MAY_SET_MODE) for a in args):
        return
    Hydra.get_mode = _mode_unset  # type: ignore[method-assign]


def _mode_unset(self: Any, config_name: str | None, overrides: list[str]) -> None:
    """Hydra's answer when no config sets `hydra.mode`: the command line decides."""
    return None


def search_dirs(args: list[str]) -> list[Path] | None:
    """The folders `hydra.searchpath=[file://DIR,...]` joins; None when an entry is not a
    plain folder (`pkg://`) and so cannot be checked here."""
    dirs: list[Path] = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key.lstrip("+") != "hydra.searchpath":
            continue
        for entry in value.strip("[]").split(","):
            entry = entry.strip().strip("'\"")
            if not entry.startswith("file://"):
                return None if entry else dirs
            dirs.append(Path(entry.removeprefix("file://")))
    return dirs


def check_selection(group: str, name: str, config_dir: Path, args: list[str]) -> None:
    """`data=NAME` names a file of the group in cumulus's configs or a joined folder: else one
    paragraph saying where it was looked for and how to join a folder (Hydra's own message,
    "Could not find 'data/NAME'", does not)."""
    if name.startswith("[") and name.endswith("]"):  # callbacks=[ema,grad_stats]
        for one in name[1:-1].split(","):
            check_selection(group, one.strip(), config_dir, args)
        return
    if not name or name == "null" or any(c in name for c in ",($*{"):  # sweeps, functions
        return
    dirs = search_dirs(args)
    found = [config_dir, *(dirs or [])]
    if dirs is None or any((d / group / f"{name}.yaml").exists() for d in found):
        return
    shipped = "|".join(sorted(p.stem for p in (config_dir / group).glob("*.yaml")))
    where = (
        "; the folders joined by hydra.searchpath ("
        + ", ".join(str(d) for d in dirs)
        + f") have no {group}/{name}.yaml either"
        if dirs
        else ". A config of your own is found once its folder is joined: add "
        f"`hydra.searchpath=[file://DIR]` where DIR holds {group}/{name}.yaml (an absolute "
        "path; `config_dir=` in trainer.api)"
    )
    raise ConfigError(group, f"no config named {name!r}: cumulus ships {group}={shipped}{where}.")


def check_value_type(key: str, value: str) -> None:
    """`train.max_steps=abc` fails here in one line, not in Hydra's multi-line report.
    Checked against the section that holds the key (`TrainCfg` for `train.max_steps`), not
    the whole schema: ~30 ms less per override in every process of every launch."""
    *parents, leaf = key.split(".")
    schema: type = Config
    for part in parents:
        hint = schema_hints(schema).get(part)
        if not dataclasses.is_dataclass(hint):
            return  # a free-form node (a component's arguments): Hydra and the builder check
        schema = hint
    section = OmegaConf.structured(schema)
    try:
        OmegaConf.merge(section, OmegaConf.from_dotlist([f"{leaf}={value}"]))
    except OmegaConfBaseException as exc:
        if not isinstance(exc, omegaconf.errors.ValidationError):
            return  # not a type problem: leave it to Hydra
        default = OmegaConf.select(section, leaf)
        reason = str(exc).strip().splitlines()[0]
        off = f". {off_at_zero(key)}" if key in OFF_AT_ZERO else ""
        raise ConfigError(key, f"{reason}; the default is {default!r}{off}") from None


def _check_composed(cfg: DictConfig, schema: type = Config, parts: tuple[str, ...] = ()) -> None:
    """Keys that reached the composed config without a place in the schema (a `+key=` in a
    config file): `OmegaConf.to_object` would drop them silently."""
    hints = schema_hints(schema)
    for key in map(str, cfg):
        error = unknown_key([*parts, key])
        if error is not None:
            raise error
        if dataclasses.is_dataclass(hints.get(key)):
            _check_composed(cfg[key], hints[key], (*parts, key))


def to_config(cfg: DictConfig) -> tuple[Config, dict[str, Any]]:
    """Validated dataclasses (runs every `__post_init__`) and the resolved plain dict. Beside
    `model.pretrained`, the in-tree defaults of `model.config` are left out: the directory's
    own values stand (trainer/config/pretrained.py)."""
    _check_composed(cfg)
    register_random_init()
    try:
        cfg = keep_directory_values(cfg)
        obj = OmegaConf.to_object(cfg)
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, UserError) else None
        if cause is not None:
            raise cause from None
        if isinstance(exc, omegaconf.errors.InterpolationResolutionError):
            raise interpolation_error(cfg, exc) from None
        raise UserError(f"invalid config: {exc}".replace("\n", " ")) from None
    from trainer.run.assemble import check_config

    check_config(obj)  # type: ignore[arg-type]
    return obj, plain  # type: ignore[return-value]


def interpolation_error(cfg: DictConfig, exc: OmegaConfBaseException) -> ConfigError:
    """`${a.b}` that does not resolve: the key holding it, what it refers to, and what
    exists there."""
    key = exc.full_key or "?"
    text = str(exc).strip().splitlines()[0]
    try:
        raw = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw[part]  # type: ignore[index]
    except (KeyError, TypeError):
        raw = None
    missing = text.split("'")[1] if text.count("'") >= 2 else None
    hint = ""
    if missing and "." in missing:
        parent, leaf = missing.rsplit(".", 1)
        try:
            node = OmegaConf.select(cfg, parent, throw_on_missing=False)
        except OmegaConfBaseException:
            node = None
        if isinstance(node, DictConfig):
            names = [str(k) for k in node]
            close = difflib.get_close_matches(leaf, names, n=1)
            hint = f"Did you mean `${{{parent}.{close[0]}}}`? " if close else ""
            hint += f"Keys of {parent}: {', '.join(sorted(names))}."
    holds = f"its value {raw!r}" if isinstance(raw, str) else "its value"
    return ConfigError(
        key,
        f"{holds} is an interpolation that does not resolve ({text}). An interpolation "
        f"`${{a.b}}` names a key of the composed config by its full path. {hint}".strip(),
    )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_peer_failure(exc: BaseException) -> bool:
    """A collective that failed because another rank died or hung up."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistNetworkError):
        return True
    text = str(exc)
    return any(
        s in text for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    )


def exit_with(error: UserError) -> None:
    """Print a user error once (rank 0 under torchrun: every rank sees the same input)."""
    if _rank() == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    exit_user_error(printed=_rank() == 0)


# How long a silent rank waits for rank 0 to print the error they share.
SPEAKER_GRACE_S = 10.0


def exit_user_error(printed: bool) -> None:
    """Exit with the user-error code. A rank that left the printing to rank 0 exits after
    rank 0 (torchrun then stops it): exiting first, it would have torchrun kill rank 0 before
    the error reached the screen."""
    if not printed:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop ends the wait
        time.sleep(SPEAKER_GRACE_S)
    sys.exit(EXIT_USER_ERROR)


def run_command(
    cfg: DictConfig,
    body: Callable[[Config, dict[str, Any], DistInfo], T],
    before_joining: Callable[[Config], None] | None = None,
) -> T:
    """Validate, run `before_joining` (refusals the config decides: every rank refuses alike
    before any of them waits for the others in the process group's rendezvous, so no rank is
    left connecting to one that has already exited), join the process group, run `body`,
    leave cleanly; exit non-zero on error."""
    from engine.parallel import LayoutError  # nothing imported: cheap

    info: DistInfo | None = None
    try:
        config, plain = to_config(cfg)
        if before_joining is not None:
            before_joining(config)
        from engine.distributed import init_distributed  # torch: after a config that is valid

        info = init_distributed(config.dist.backend, config.train.device, config.dist.timeout_s)
        result = body(config, plain, info)
    except UserError as exc:
        user_error(exc, info)
    except LayoutError as exc:  # an engine refusal met while running: a batch it cannot split
        user_error(ConfigError(exc.key, str(exc)), info)
    except Exception as exc:
        rank = info.rank if info is not None and info.distributed else None
        if rank is not None and is_peer_failure(exc):
            # The rank that failed prints its own error; a wall of gloo/NCCL frames here
            # would only bury it.
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"[rank {rank}] stopped: another rank failed ({first[:200]})", file=sys.stderr)
        else:
            prefix = f"[rank {rank}] " if rank is not None else ""
            # A failure in the user's own code: one line naming the component comes first.
            head = getattr(exc, "cumulus_context", "training failed:")
            print(f"{prefix}{head}\n{traceback.format_exc()}", file=sys.stderr)
        sys.stderr.flush()
        leave_process_group(clean=False)
        sys.exit(1)
    # Free what the run built (DDP's reducer, loader workers) while the process group still
    # exists: destroyed later, at interpreter exit, gloo's threads can abort the process.
    gc.collect()
    leave_process_group(clean=True)
    return result


def user_error(exc: UserError, info: DistInfo | None) -> NoReturn:
    """Print a user error once (or per rank, for one that names its rank) and exit 2."""
    # Config, batch arithmetic and divergence errors hit every rank alike: rank 0 speaks.
    # Others (a data file missing on one node) name their rank. A `quiet` error was printed
    # where it arose, on the rank chosen to say it (`printed`): a hung rank is named by the
    # first rank that waited for it (trainer/run/hang.py).
    shared = info is None or not info.distributed or exc.all_ranks
    if exc.quiet:
        printed = exc.printed
    elif not shared:
        print(f"error (rank {info.rank}): {exc}", file=sys.stderr, flush=True)
        printed = True
    else:
        printed = _rank() == 0
        if printed:
            print(f"error: {exc}", file=sys.stderr, flush=True)
    leave_process_group(clean=False)
    exit_user_error(printed=printed)


def leave_process_group(clean: bool) -> None:
    """Leave the process group if this process joined one (a refused config never loaded
    torch: nothing to leave)."""
    if "torch.distributed" in sys.modules:
        from engine.distributed import shutdown_distributed

        shutdown_distributed(clean=clean)
