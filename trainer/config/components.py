"""Components from config: `_target_` plus keyword arguments, checked against the target's
signature before anything is built, and built with errors that name the config key.

A component node (`model`, `task`, `data`, `optim`, `scheduler`, `step`, `callbacks.NAME`)
is `{_target_: pkg.mod.Name, <its arguments>, <keys the trainer reads itself>}`. Hydra's
`instantiate` builds it (nested `_target_`s too; containers arrive as plain dicts and
lists). Before that, `check` imports the target and compares the arguments with its
signature: an unknown key, a value of the wrong type (from the annotations) or a missing
required argument is a one-paragraph `ConfigError` naming the key, before any work starts.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainer.config.errors import ConfigError

TARGET, PARTIAL = "_target_", "_partial_"
# Targets cumulus shipped under another module path: a checkpoint's saved config may name them.
MOVED = {
    "engine.accumulate.": "engine.steps.accumulate.",
    "engine.sam.": "engine.steps.sam.",
    "engine.dp_sgd.": "engine.steps.dp_sgd.",
    "engine.ema.": "engine.callbacks.ema.",
    "engine.grad_stats.": "engine.callbacks.grad_stats.",
    "engine.noise_scale.": "engine.callbacks.noise_scale.",
}
_HYDRA_KEYS = {TARGET, PARTIAL, "_convert_", "_recursive_", "_args_"}


def current_targets(node: Any) -> Any:
    """`node` (a saved config) with the `_target_`s of moved cumulus modules renamed."""
    if isinstance(node, dict):
        out = {k: current_targets(v) for k, v in node.items()}
        target = out.get(TARGET)
        if isinstance(target, str):
            for old, new in MOVED.items():
                if target.startswith(old):
                    out[TARGET] = new + target.removeprefix(old)
        return out
    if isinstance(node, list):
        return [current_targets(v) for v in node]
    return node


def locate(path: Any, key: str) -> Callable[..., Any]:
    """The object a `_target_` names (`pkg.mod.Name`, also `pkg.mod.Class.method`)."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key}.{TARGET}", f"must name a class or function, got {path!r}")
    parts = path.split(".")
    obj, error = None, None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not ".".join(parts[:i]).startswith(exc.name):
                error = exc  # the module exists but an import inside it failed
                break
            continue
        except Exception as exc:  # the module raised while importing
            error = exc
            break
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                error = AttributeError(f"{'.'.join(parts[:i])} has no attribute {attr!r}")
                obj = None
                break
            obj = getattr(obj, attr)
        break
    if obj is None or error is not None:
        why = f": {type(error).__name__}: {error}" if error is not None else ""
        raise ConfigError(
            f"{key}.{TARGET}",
            f"cannot import {path}{why}. A _target_ is the dotted path of a class or function; "
            "is its package installed or on PYTHONPATH?",
        )
    if not callable(obj):
        raise ConfigError(f"{key}.{TARGET}", f"{path} is a {type(obj).__name__}, not callable")
    return obj


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        return typing.get_type_hints(target)
    except Exception:  # unresolvable annotations: check names only
        return {}


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is type(None):
        return "null"
    if origin is not None:
        return getattr(origin, "__name__", str(origin)) + "[...]"
    return {int: "an int", float: "a number", bool: "true/false", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _matches(value: Any, hint: Any) -> bool:
    """Whether a config value can be passed where `hint` is annotated. Unknown types pass."""
    if hint is Any or isinstance(hint, typing.TypeVar | str):
        return True
    if isinstance(value, Mapping) and TARGET in value:
        return True  # a nested component: instantiated first
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if not isinstance(value, list | tuple):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(map(_matches, value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return isinstance(value, Mapping)
    # A config value is never a tensor; of any other class nothing can be told.
    return not (inspect.isclass(hint) and hint.__module__ == "torch" and hint.__name__ == "Tensor")


def check(
    spec: Mapping[str, Any],
    key: str,
    provided: Sequence[str] = (),
    options: Sequence[str] = (),
) -> Callable[..., Any]:
    """Import `spec`'s target and check its arguments against the signature; return it.

    `provided` are the arguments the trainer passes itself (e.g. an optimizer's `params`);
    `options` are the group's config names, mentioned in errors (`optim=adamw|sgd`).
    """
    if not isinstance(spec, Mapping) or TARGET not in spec:
        hint = f"; or select one of {key}={'|'.join(options)}" if options else ""
        raise ConfigError(key, f"needs a {TARGET} (a class or function path){hint}, got {spec!r}")
    target = locate(spec[TARGET], key)
    kwargs = {k: v for k, v in spec.items() if k not in _HYDRA_KEYS}
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return target
    named = {
        n: p
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in provided
    }
    open_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
    needed = [n for n in provided if n in params and params[n].default is params[n].empty]
    if needed and spec.get(PARTIAL) is not True:
        raise ConfigError(
            f"{key}.{PARTIAL}",
            f"{spec[TARGET]} gets its {', '.join(needed)} from the trainer at run time, so "
            f"the config must be a partial: add `{PARTIAL}: true` next to `{TARGET}` (on the "
            f"command line `+{key}.{PARTIAL}=true`); without it Hydra calls it at once, "
            f"missing its {', '.join(needed)}",
        )
    unknown = [] if open_kwargs else [n for n in kwargs if n not in named]
    for name in unknown[:1]:
        close = difflib.get_close_matches(name, named, n=1)
        hint = f"Did you mean `{key}.{close[0]}`? " if close else ""
        others = f" (nor {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""
        groups = f" (or select {key}={'|'.join(options)})" if options else ""
        if not close:  # likely left over from the group's config after `_target_` changed
            them = "them" if unknown[1:] else "it"
            drop = " ".join(f"~{key}.{n}" for n in unknown)
            groups = (
                f". Left over from the config whose `{key}.{TARGET}` you changed? Drop {them} "
                f"with `{drop}` (an override, on the command line or in api.train's list)"
                + (
                    f", or select a config of the group instead: {key}={'|'.join(options)}"
                    if options
                    else ""
                )
            )
        raise ConfigError(
            f"{key}.{name}",
            f"unknown key: {spec[TARGET]} takes no argument {name!r}{others}. {hint}Valid keys "
            f"of {key}: {', '.join(sorted(named)) or 'none'}{groups}.",
        )
    hints = _hints(target)
    for name, value in kwargs.items():
        if name in hints and not _matches(value, hints[name]):
            raise ConfigError(f"{key}.{name}", f"must be {_describe(hints[name])}, got {value!r}")
        if isinstance(value, Mapping) and TARGET in value:
            check(value, f"{key}.{name}")
    missing = [n for n, p in named.items() if p.default is p.empty and n not in kwargs]
    if missing:
        raise ConfigError(
            f"{key}.{missing[0]}",
            f"{spec[TARGET]} needs {', '.join(missing)}: set "
            + ", ".join(f"+{key}.{n}=..." for n in missing),
        )
    return target


def instantiate(spec: Mapping[str, Any], key: str, provided: Sequence[str] = ()) -> Any:
    """Check and build `spec` (a `functools.partial` when it sets `_partial_: true`, to be
    completed with `call`). Errors while building name the config key (`failure`)."""
    import hydra

    check(spec, key, provided=provided)
    try:
        return hydra.utils.instantiate(dict(spec), _convert_="all")
    except Exception as exc:
        raise failure(exc, spec, key) from None


def call(factory: Callable[..., Any], spec: Mapping[str, Any], key: str, *args: Any) -> Any:
    """Complete a partial component with runtime objects (an optimizer's parameters)."""
    try:
        return factory(*args)
    except Exception as exc:
        raise failure(exc, spec, key) from None


def failure(exc: BaseException, spec: Mapping[str, Any], key: str) -> BaseException:
    """What to raise when a component's constructor failed. Bad values (ValueError,
    TypeError, a missing file, ...) become a ConfigError naming the argument's key when the
    message starts with an argument's name ("n_head must be ..."), else the node. Anything
    else is a bug in the component and keeps its own exception (and traceback)."""
    root = exc
    while root.__cause__ is not None:  # Hydra wraps the constructor's own error
        root = root.__cause__
    if not isinstance(root, ValueError | TypeError | KeyError | OSError | ImportError):
        return root
    text = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    first = text.split(" ", 1)[0].strip("`'\":,")
    # "moe.top_k must ...": a key of a nested argument (model.moe.top_k) is named whole.
    if first.split(".")[0] in {k for k in spec if k not in _HYDRA_KEYS}:
        return ConfigError(f"{key}.{first}", text)
    return ConfigError(key, f"building {spec[TARGET]} failed: {type(root).__name__}: {text}")
