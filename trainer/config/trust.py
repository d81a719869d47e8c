"""The trust boundary for configs read from files: a checkpoint's saved config is data.

A checkpoint received from elsewhere carries the config of the run that wrote it, and
rebuilding that run (`trainer.evaluate`, `scripts/export_hf.py`) instantiates its `_target_`s.
Any importable callable with arguments taken from the file would be reachable, and importing
a module already runs its code. So before anything of a file's config is imported or built,
every `_target_` in it, nested ones inside a component's arguments included, must be one of:

- a target cumulus itself ships: the exact dotted paths in `configs/` and the schema defaults;
- a target the user states themselves: on the command line (`model._target_=mypkg.Net`) or
  in a config folder given by `hydra.searchpath`;
- under a module prefix the user trusts with `trust=[mypkg,...]` (`mypkg` trusts
  `mypkg.models.Net`, not `mypkgx.Net`).

Anything else is refused with one paragraph naming the key, the target and the `trust=[...]`
that would allow it. The check reads strings only: nothing is imported to decide.

Paths are data too. A saved config can name any file to read (data, validation data, a
tokenizer, a pretrained directory, a chat template) and any directory to write (a token
cache). A path the file sets (one that differs from what this version's configs give and
that the user did not restate) is not used: the user gives it on the command line
(`data.path=...`) or says `saved_paths=true` to take the file's paths. Nothing is read or
written where a received file alone says so.

A config this user's secret signed (trainer/config/signing.py) is their own run's: its targets
and paths are theirs. The keys a run derived from others (`data.pretrained` from
`model.pretrained`) are saved beside the resolved config as references to other keys
(`derived_keys`), never through a resolver, and derived again from what the user gives now.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer.config.errors import UserError

TARGET = "_target_"
_PREFIX = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class UntrustedConfigError(UserError):
    """A config read from a file names code the user has not trusted."""

    all_ranks = True


def targets(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """Every `(config key, _target_ value)` in `node`, nested mappings and lists included."""
    if isinstance(node, dict):
        for name, value in node.items():
            sub = f"{key}.{name}" if key else str(name)
            if name == TARGET:
                yield sub, value
            else:
                yield from targets(value, sub)
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from targets(value, f"{key}[{i}]")


def _leaves(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for name, value in node.items():
            yield from _leaves(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{key}[{i}]")
    else:
        yield key, node


def _interpolations(node: Any) -> Iterator[str]:
    """Keys whose value is an OmegaConf interpolation (`${...}`): a saved config is resolved,
    so one there was put by hand, and resolving it could hide what a `_target_` names."""
    return (key for key, value in _leaves(node) if isinstance(value, str) and "${" in value)


# A reference to another key: `${a.b}`, `${.sibling}` or `${oc.select:a.b,DEFAULT}` whose
# default is a literal or another such reference. No other resolver: one could read the
# environment or a file.
_REFERENCE = re.compile(r"\$\{(?:oc\.select:)?\.*[A-Za-z_][A-Za-z0-9_.]*(?:,[A-Za-z0-9_.+\-]*)?\}")


def is_reference(value: Any) -> bool:
    """Whether `value` is, as a whole, an interpolation that only copies another key's value
    (or a literal default): innermost references are folded until one is left."""
    if not isinstance(value, str) or "${" not in value:
        return False
    rest = value
    while (folded := _REFERENCE.sub("R", rest)) != rest:
        rest = folded
    return rest == "R"


def derived_keys(cfg: Any) -> dict[str, str]:
    """The keys of a composed config (a DictConfig) whose value another key gives
    (`data.pretrained: ${oc.select:model.pretrained,null}`), with their interpolation. A
    checkpoint saves its config resolved and these beside it, so that evaluation and export
    derive them again from what the user gives then (`model.pretrained=NEW_DIR`)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False)
    return {
        key: value
        for key, value in _leaves(raw)
        if "[" not in key
        and not key.endswith(TARGET)
        and not key.startswith("hydra.")
        and is_reference(value)
    }


def check_derived(derived: Any, source: Path) -> dict[str, str]:
    """The derived keys saved in `source` (none before they were saved), each a reference to
    another key, as cumulus writes them; refused otherwise."""
    if derived is None:
        return {}
    if not isinstance(derived, dict):
        raise UntrustedConfigError(
            f"checkpoint: {source} holds derived keys that are not a mapping (got "
            f"{type(derived).__name__}); it was not written by cumulus or was altered"
        )
    for key, value in derived.items():
        if not isinstance(key, str) or "[" in key or key.endswith(TARGET):
            raise UntrustedConfigError(
                f"checkpoint: {source} derives {key!r}, which cumulus never derives; it was "
                "altered and is not used. Nothing from it was imported or run."
            )
        if not is_reference(value):
            raise UntrustedConfigError(
                f"checkpoint: {source} derives `{key}` as {value!r}, which is not a reference "
                "to another key as cumulus saves them; it was altered and is not used. Nothing "
                "from it was imported or run."
            )
    return derived


def _yaml_targets(folder: Path) -> set[str]:
    """The `_target_` values written in the YAML files under `folder` (read as plain YAML)."""
    found: set[str] = set()
    for path in sorted(folder.rglob("*.yaml")):
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue  # Hydra reports a broken config file of the user's itself
        found.update(v for _, v in targets(doc) if isinstance(v, str))
    return found


def shipped_targets(config_dir: Path) -> set[str]:
    """What cumulus ships: every `_target_` in its `configs/` and in the schema's defaults."""
    from omegaconf import OmegaConf

    from trainer.config.schema import Config

    defaults = OmegaConf.to_container(OmegaConf.structured(Config))
    return _yaml_targets(config_dir) | {v for _, v in targets(defaults) if isinstance(v, str)}


# Config keys that name a file or directory: by name, in any node (a user's data source's
# `root=` included). The run's own outputs (checkpoint, logger, plan) are not rebuilt from a
# saved config, so only what evaluation and export build is looked at.
PATH_KEYS = frozenset(
    {"path", "paths", "val_path", "tokenizer", "cache_dir", "pretrained", "chat_template"}
    | {"root", "dir", "file", "files", "data_dir", "data_files"}
)
PATH_SUFFIXES = ("_path", "_paths", "_dir", "_file", "_files")
# What evaluation rebuilds from a saved config (an export reads less: its own list).
BUILT_FROM_SAVED = ("model", "task", "data", "callbacks")


def is_path_key(key: str) -> bool:
    name = key.rsplit(".", 1)[-1].split("[", 1)[0]
    return name in PATH_KEYS or name.endswith(PATH_SUFFIXES)


def parse_saved_paths(args: Sequence[str]) -> tuple[bool, list[str]]:
    """Split `saved_paths=true|false` off the command line: (its value, the rest)."""
    allow, rest = False, []
    for arg in args:
        if not arg.startswith("saved_paths="):
            rest.append(arg)
            continue
        value = arg.split("=", 1)[1].strip().lower()
        if value not in ("true", "false"):
            raise UserError(
                f"saved_paths: {value!r} is not a boolean; saved_paths=true uses the file and "
                "directory paths a checkpoint's config names (data, tokenizer, pretrained "
                "model, cache), saved_paths=false (the default) refuses them"
            )
        allow = value == "true"
    return allow, rest


def _same_path(value: str) -> str:
    return os.path.normpath(os.path.expanduser(value.strip().strip("'\"")))


def _select(node: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.create(node), key, default=None)


def check_paths(
    config: Any,
    fresh: Any,
    source: Path,
    *,
    overrides: Sequence[str] = (),
    allow: bool = False,
    uses: Sequence[str] = BUILT_FROM_SAVED,
    command: str = "python -m trainer.evaluate",
) -> None:
    """Refuse a path that only the file read from `source` sets: a path-named key (`data.path`,
    `model.pretrained`, `data.cache_dir`...) under what the command reads (`uses`: nodes or
    keys) whose value differs from this version's own configs composed with the user's
    overrides (`fresh`) and that the user did not restate. `allow` (`saved_paths=true`)
    takes the file's paths."""
    if allow:
        return
    stated = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    # A path the user typed for another key is theirs too (a tokenizer that defaults to the
    # pretrained directory, `data.tokenizer=${model.pretrained}`, saved resolved).
    named = {
        _same_path(value)
        for key, value in (o.split("=", 1) for o in overrides if "=" in o)
        if is_path_key(key) and value
    }
    for node in dict.fromkeys(u.split(".", 1)[0] for u in uses):
        for key, value in _leaves(config.get(node), node):
            if not any(key == u or key.startswith(u + ".") for u in uses):
                continue
            if not is_path_key(key) or value in (None, "", []) or key in stated:
                continue
            if value == _select(fresh, key):
                continue  # what this version's configs give: not the file's choice
            if isinstance(value, str) and _same_path(value) in named:
                continue
            raise UntrustedConfigError(
                f"checkpoint: the config saved in {source} sets `{key}: {value!r}`, a path, "
                "and paths in a checkpoint's config are data: cumulus does not read from or "
                "write to where a received file alone says. Nothing was read or written. "
                f"Give it yourself (`{key}=...`, the same value or your own), or, if you "
                f"trust this checkpoint's paths, add `saved_paths=true` to `{command} ...`."
            )


def parse_trust(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split `trust=[a,b]` (also `trust=a`) off the command line: (prefixes, the rest)."""
    prefixes: list[str] = []
    rest = []
    for arg in args:
        if not arg.startswith("trust="):
            rest.append(arg)
            continue
        value = arg.split("=", 1)[1].strip()
        if value.startswith("[") and value.endswith("]"):
            value = value[1:-1]
        for item in (v.strip().strip("'\"") for v in value.split(",")):
            if not item:
                continue
            if not _PREFIX.match(item):
                raise UserError(
                    f"trust: {item!r} is not a module prefix; expected dotted Python names "
                    "such as trust=[mypkg] or trust=[mypkg.models,otherpkg]"
                )
            prefixes.append(item)
    return prefixes, rest


def user_targets(overrides: Sequence[str]) -> set[str]:
    """Targets the user states: `..._target_=X` overrides and those in the config folders
    `hydra.searchpath=[file://DIR,...]` joins."""
    stated: set[str] = set()
    for override in overrides:
        if "=" not in override:
            continue
        key, value = override.split("=", 1)
        key = key.lstrip("+~")
        if key.split(".")[-1] == TARGET:
            stated.add(value.strip().strip("'\""))
        elif key == "hydra.searchpath":
            for entry in value.strip("[]").split(","):
                entry = entry.strip().strip("'\"")
                if entry.startswith("file://"):
                    entry = entry[len("file://") :]
                if entry and Path(entry).expanduser().is_dir():
                    stated |= _yaml_targets(Path(entry).expanduser())
    return stated


def _trusted_by(target: str, prefixes: Sequence[str]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def check_saved(saved: Any, source: Path) -> None:
    """A config read from `source` must be a plain resolved mapping, as cumulus writes it."""
    if not isinstance(saved, dict):
        raise UntrustedConfigError(
            f"checkpoint: {source} holds no config mapping (got {type(saved).__name__}); "
            "it was not written by cumulus or was altered"
        )
    hidden = list(_interpolations(saved))
    if hidden:
        raise UntrustedConfigError(
            f"checkpoint: the config saved in {source} has an interpolation at `{hidden[0]}`; "
            "cumulus saves configs resolved, so this one was altered and is not used. Nothing "
            "from it was imported or run."
        )


def check_targets(
    config: Any,
    source: Path,
    *,
    config_dir: Path,
    overrides: Sequence[str] = (),
    trust: Sequence[str] = (),
    command: str = "python -m trainer.evaluate",
) -> None:
    """Refuse `config` (read from `source`, the user's overrides on top, unresolved) if it
    names a target that is not trusted. The composed config is what is checked, so a node
    the user replaces (`model=gpt_tiny`) is not held against the file. Nothing is imported."""
    allowed = shipped_targets(config_dir) | user_targets(overrides)
    for key, target in targets(config):
        if isinstance(target, str) and (target in allowed or _trusted_by(target, trust)):
            continue
        # The prefix to trust: the target's top-level package.
        top = target.split(".")[0] if isinstance(target, str) and target else "PKG"
        raise UntrustedConfigError(
            f"checkpoint: the config saved in {source} names `{key}: {target!r}`, which is "
            "not a target cumulus ships, and a checkpoint's config is untrusted input: "
            "building it would import and run that code. Nothing was imported, built or "
            "written. If you trust the code the checkpoint came with, say so: "
            f"`{command} ... trust=[{top}]` (module prefixes), or restate it yourself "
            f"(`{key}={target}`, or a config folder given by hydra.searchpath)."
        )
