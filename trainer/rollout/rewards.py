"""Rewards for `task=grpo` (`reward.funcs`, `reward.weights`): functions with weights.

A reward function has TRL's signature, so that TRL's reward functions plug in unchanged:

    fn(prompts, completions, completion_ids, **row_fields) -> list[float | None]

one list entry per completion: `prompts[k]` is completion k's prompt as the data holds it (a
string, or a list of messages), `completions[k]` its text (for a prompt of messages, one
assistant message: `[{"role": "assistant", "content": text}]`, as TRL passes it),
`completion_ids[k]` its token ids, and every other field of the prompt's row as a list of the
same length (`answer=[...]`). A function may take only the arguments it needs and `**kwargs`
for the rest. None means the function does not apply to that completion (TRL's convention);
a completion every function declined gets advantage 0 (engine/rl/advantages.py). A
completion's reward is the sum of weight x score over the functions.

An entry is `{_target_: pkg.fn, weight: 1.0, name: NAME, <keyword arguments>}`: the function
itself, its other keys bound as keyword arguments, each naming one of its parameters
(`pattern:` of `format_match`). Built in:
`trainer.rollout.rewards.exact_answer`, `trainer.rollout.rewards.format_match`,
`trainer.rollout.rewards.length_penalty`.
A target named in a received checkpoint's config goes through the trust boundary as every
`_target_` there (trainer/config/trust.py): refused unless shipped, restated or trusted.

Bad input, one paragraph each naming the entry's key: a function that returns another number
of scores than completions, or a score that is not a number (or None); one that raises (the
failing completion found by calling it one completion at a time; its traceback shown once,
after the paragraph, with the prompt's row); a prompts file without a field a function takes
(`check_fields`, when the data is opened).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.config.components import TARGET, locate
from trainer.config.errors import ConfigError, UserError

# What every call passes; the rest of a function's required parameters are row fields.
PASSED = ("prompts", "completions", "completion_ids")
ENTRY_KEYS = ("weight", "name")


# --------------------------------------------------------------------------- built in


def completion_text(completion: Any) -> str:
    """A completion's text: the string, or its (last) message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    return str(completion)


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """A completion's final answer: the last `\\boxed{}`'s content, else its last number."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers_found = NUMBER.findall(text)
    return numbers_found[-1] if numbers_found else None


def _same_answer(got: str, want: Any) -> bool:
    a, b = got.strip().replace(",", ""), str(want).strip().replace(",", "")
    try:
        return math.isclose(float(a), float(b), rel_tol=0.0, abs_tol=1e-9)
    except ValueError:
        return a == b


def exact_answer(completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any) -> list[float]:
    """1 where the completion's final answer (`final_answer`) equals the row's `answer`
    (numbers compared as numbers: "1,000" is 1000.0), else 0."""
    del kwargs
    out = []
    for completion, want in zip(completions, answer, strict=True):
        got = final_answer(completion_text(completion))
        out.append(1.0 if got is not None and _same_answer(got, want) else 0.0)
    return out


def format_match(completions: Sequence[Any], pattern: str, **kwargs: Any) -> list[float]:
    """1 where the completion's text matches `pattern` from its start (Python `re.match`,
    DOTALL and MULTILINE, as TRL's format rewards), else 0."""
    del kwargs
    regex = re.compile(pattern, re.DOTALL | re.MULTILINE)
    return [1.0 if regex.match(completion_text(c)) else 0.0 for c in completions]


def length_penalty(
    completion_ids: Sequence[Sequence[int]], max_length: int, buffer: int, **kwargs: Any
) -> list[float]:
    """DAPO's soft overlong punishment of a completion of n tokens: 0 up to max_length -
    buffer, then falling linearly to -1 at max_length, -1 beyond."""
    del kwargs
    if not 0 < buffer <= max_length:
        raise ValueError(f"length_penalty: 0 < buffer <= max_length, got {buffer}, {max_length}")
    safe = max_length - buffer
    out = []
    for ids in completion_ids:
        n = len(ids)
        out.append(0.0 if n <= safe else (safe - n) / buffer if n <= max_length else -1.0)
    return out


# --------------------------------------------------------------------------- the set


class RewardFailed(UserError):
    """A reward function broke its contract or raised (one paragraph; a traceback after)."""


@dataclass(frozen=True)
class Reward:
    """One entry of `reward.functions`: its function (entry keywords bound), weight, name and
    config key (for errors)."""

    fn: Callable[..., Any]
    weight: float
    name: str
    key: str

    @property
    def fields(self) -> tuple[str, ...]:
        """The row fields the function requires (its required parameters but those every
        call passes)."""
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):
            return ()
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return tuple(
            p.name
            for p in params
            if p.kind in kinds and p.default is p.empty and p.name not in PASSED
        )


def build_rewards(entries: Sequence[Mapping[str, Any]], key: str = "reward.functions") -> Rewards:
    """The functions of config `entries` (each `{_target_, weight, name, kwargs...}`)."""
    if not entries:
        raise ConfigError(key, "task=grpo needs at least one reward function (`_target_: ...`)")
    rewards = [_reward(entry, f"{key}[{i}]") for i, entry in enumerate(entries)]
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        raise ConfigError(key, f"reward names must differ (they name records); got {names}")
    return Rewards(rewards)


def rewards_of_config(funcs: Mapping[str, Any], weights: Mapping[str, Any]) -> Rewards:
    """The run's rewards from `reward.funcs` (NAME: {_target_, kwargs...}) and
    `reward.weights` (NAME: weight, 1.0 for a function not listed)."""
    if not funcs:
        raise ConfigError(
            "reward",
            "task=grpo needs at least one reward function: select reward=[exact_answer] "
            "(configs/reward/: exact_answer, format, length), or add your own as "
            "reward.funcs.NAME._target_=pkg.fn (TRL's signature: fn(prompts, completions, "
            "**row_fields) -> list[float])",
        )
    unknown = [n for n in weights if n not in funcs]
    if unknown:
        raise ConfigError(
            f"reward.weights.{unknown[0]}",
            f"names no function of reward.funcs (its functions: {', '.join(funcs)})",
        )
    entries = {
        name: {**dict(entry), "name": name, "weight": weights.get(name, 1.0)}
        if isinstance(entry, Mapping)
        else entry
        for name, entry in funcs.items()
    }
    return Rewards([_reward(e, f"reward.funcs.{n}") for n, e in entries.items()])


def _reward(entry: Any, where: str) -> Reward:
    """One entry (`{_target_, weight, name, kwargs...}`), its errors naming `where`."""
    if not isinstance(entry, Mapping) or TARGET not in entry:
        shape = "{_target_: pkg.fn, weight: 1.0}"
        raise ConfigError(where, f"a reward is {shape}, got {entry!r}")
    fn = locate(entry[TARGET], where)
    kwargs = {k: v for k, v in entry.items() if k != TARGET and k not in ENTRY_KEYS}
    _check_kwargs(fn, kwargs, where, str(entry[TARGET]))
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        key = where.replace("reward.funcs.", "reward.weights.") if "funcs." in where else where
        raise ConfigError(f"{key}.weight" if key == where else key, f"a number, got {weight!r}")
    name = str(entry.get("name") or str(entry[TARGET]).rsplit(".", 1)[-1])
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    return Reward(bound, float(weight), name, where)


def _check_kwargs(
    fn: Callable[..., Any], kwargs: Mapping[str, Any], where: str, target: str
) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    # A config keyword names a parameter, even of a function taking **kwargs (those are for
    # the row fields): a misspelt one would otherwise be passed along unnoticed.
    named = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    unknown = [k for k in kwargs if k not in named]
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]}",
            f"{target} takes no argument {unknown[0]!r}; its arguments: "
            f"{', '.join(n for n in named if n not in PASSED)}",
        )


class Rewards:
    """The reward functions of a run, scored together (`score`)."""

    def __init__(self, rewards: Sequence[Reward]) -> None:
        self.rewards = list(rewards)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rewards)

    @property
    def weights(self) -> torch.Tensor:
        return torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)

    def check_fields(self, fields: Sequence[str], source: str, key: str = "data.path") -> None:
        """Refuse a prompts file (`source`, whose rows have `fields`) without a field a
        function takes."""
        for reward in self.rewards:
            missing = [f for f in reward.fields if f not in fields]
            if missing:
                raise UserError(
                    f"{key}: the rows of {source} have no field {missing[0]!r}, which "
                    f"{reward.key} ({reward.name}) takes; their fields: "
                    f"{', '.join(map(repr, fields)) or 'none'}. Add it to the rows, or choose "
                    f"a reward that reads a field they have"
                )

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        rows: Sequence[Mapping[str, Any]],
    ) -> torch.Tensor:
        """(N, F) float64: every function's score of every completion (NaN: declined).
        `rows[k]`: the other fields of completion k's prompt row."""
        columns = sorted({k for row in rows for k in row})
        fields = {k: [row.get(k) for row in rows] for k in columns}
        out = torch.empty(len(completions), len(self.rewards), dtype=torch.float64)
        for f, reward in enumerate(self.rewards):
            scores = self._call(reward, prompts, completions, completion_ids, fields)
            checked = _checked(reward, scores, len(completions))
            out[:, f] = torch.tensor(checked, dtype=torch.float64)
        return out

    def _call(
        self,
        reward: Reward,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        fields: Mapping[str, list[Any]],
    ) -> Any:
        try:
            return reward.fn(
                prompts=list(prompts),
                completions=list(completions),
                completion_ids=[list(map(int, ids)) for ids in completion_ids],
                **fields,
            )
        except Exception:  # the user's code: find the completion that breaks it
            raise _failure(reward, prompts, completions, completion_ids, fields) from None


def _checked(reward: Reward, scores: Any, n: int) -> list[float]:
    if isinstance(scores, torch.Tensor | np.ndarray):
        scores = scores.tolist()
    if isinstance(scores, str | bytes) or not isinstance(scores, Sequence) or len(scores) != n:
        got = f"{len(scores)} scores" if isinstance(scores, Sequence) else type(scores).__name__
        raise RewardFailed(
            f"{reward.key} ({reward.name}) returned {got} for {n} completions: a reward "
            "function returns a list with one score (a number, or None where it does not "
            "apply) per completion, in order"
        )
    out = []
    for k, s in enumerate(scores):
        value = s.item() if isinstance(s, np.generic) else s
        if value is None:
            out.append(math.nan)
            continue
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (number and math.isfinite(value)):
            raise RewardFailed(
                f"{reward.key} ({reward.name}) returned {value!r} ({type(value).__name__}) for "
                f"completion {k}: a score is a finite number, or None where the function does "
                "not apply"
            )
        out.append(float(value))
    return out


def _failure(
    reward: Reward,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    fields: Mapping[str, list[Any]],
) -> RewardFailed:
    """The first completion the function raises on, called alone: one paragraph naming the
    entry and the prompt's row, then that call's traceback (shown once)."""
    for k in range(len(completions)):
        try:
            reward.fn(
                prompts=[prompts[k]],
                completions=[completions[k]],
                completion_ids=[list(map(int, completion_ids[k]))],
                **{name: [values[k]] for name, values in fields.items()},
            )
        except Exception as exc:
            row = {"prompt": prompts[k], **{name: values[k] for name, values in fields.items()}}
            # The function's own frames (not this call's), without the batch call's failure.
            tb = exc.__traceback__.tb_next if exc.__traceback__ else None
            frames = "".join(traceback.format_exception(type(exc), exc, tb, chain=False)).rstrip()
            return RewardFailed(
                f"{reward.key} ({reward.name}) raised {type(exc).__name__}: {exc} on completion "
                f"{completions[k]!r:.200} of the prompt row {row!r:.400}. Fix the function, "
                f"or return None for the rows it does not apply to.\n\n{frames}"
            )
    return RewardFailed(
        f"{reward.key} ({reward.name}) raised on the batch of {len(completions)} completions "
        "but on none of them alone: it depends on the batch; a reward function scores each "
        "completion on its own"
    )
