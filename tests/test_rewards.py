"""Rewards (trainer/rollout/rewards.py): TRL's signature fn(prompts, completions, completion_ids,
**row_fields) -> list[float | None], built from `{_target_, weight, name, kwargs}` entries.

Built in: exact_answer (the last \\boxed{} or the last number equals the row's answer, numbers
as numbers), format_match (re.match, DOTALL|MULTILINE) and DAPO's soft overlong length
penalty, each against values worked out here. A TRL-style user function plugs in unchanged
(conversational completions as assistant messages, the row's fields as lists, None as
declined). Bad input is one paragraph naming the entry: a wrong number of scores, a score that
is not a number, a function that raises (its failing completion's row and traceback, once),
a prompts file without a field a function takes, an unknown keyword; a reward target in a
received checkpoint's config is refused by the trust boundary unless trusted.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from trainer.config.errors import ConfigError, UserError
from trainer.config.trust import UntrustedConfigError, check_targets
from trainer.rollout.rewards import (
    RewardFailed,
    build_rewards,
    exact_answer,
    final_answer,
    format_match,
    length_penalty,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_exact_answer_reads_the_last_boxed_or_number() -> None:
    assert final_answer("so 3 + 4 = 7, and then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert final_answer("first 12, then -3.5 at last") == "-3.5"
    assert final_answer("no number here") is None
    completions = [
        "The sum is 1,000",
        "I think 41 or maybe \\boxed{42}",
        [{"role": "assistant", "content": "It is 7.0"}],  # a conversational completion
        "nothing",
        "\\boxed{x+1}",
    ]
    answers = ["1000", 42, "7", "7", "x+1"]
    assert exact_answer(completions=completions, answer=answers) == [1, 1, 1, 0, 1]


def test_format_and_length_penalty() -> None:
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    texts = ["<think>a\nb</think> <answer>3</answer>", "<answer>3</answer>", "x<think></think>"]
    assert format_match(completions=texts, pattern=pattern) == [1.0, 0.0, 0.0]
    ids = [[0] * n for n in (4, 6, 7, 8, 9)]  # max 8, buffer 2: safe up to 6
    assert length_penalty(completion_ids=ids, max_length=8, buffer=2) == [0, 0, -0.5, -1, -1]


def trl_style(prompts, completions, answer, **kwargs):
    """A TRL reward function as TRL's docs write one: conversational, declines some rows."""
    assert "completion_ids" in kwargs and isinstance(answer, list)
    out = []
    for prompt, completion, want in zip(prompts, completions, answer):
        assert isinstance(prompt, list) and completion[0]["role"] == "assistant"
        out.append(None if want is None else float(completion[0]["content"] == str(want)))
    return out


def test_a_trl_reward_function_plugs_in_with_weights() -> None:
    rewards = build_rewards(
        [
            {"_target_": f"{__name__}.trl_style", "weight": 2.0},
            {
                "_target_": "trainer.rollout.rewards.format_match",
                "pattern": r"\d+$",
                "name": "digits",
            },
        ]
    )
    assert rewards.names == ("trl_style", "digits")
    assert rewards.weights.tolist() == [2.0, 1.0]
    prompt = [{"role": "user", "content": "1+1?"}]
    completions = [[{"role": "assistant", "content": c}] for c in ("2", "3", "x")]
    rows = [{"answer": 2}, {"answer": 2}, {"answer": None}]
    scores = rewards.score([prompt] * 3, completions, [[5], [6], [7]], rows)
    assert scores[:, 0].tolist()[:2] == [1.0, 0.0] and math.isnan(scores[2, 0])
    assert scores[:, 1].tolist() == [1.0, 1.0, 0.0]
    rewards.check_fields(["prompt", "answer"], "p.jsonl")
    with pytest.raises(UserError) as err:
        rewards.check_fields(["prompt", "solution"], "p.jsonl")
    text = str(err.value)
    assert "data.path" in text and "'answer'" in text and "reward.functions[0]" in text


def wrong_count(completions, **kwargs):
    return [1.0, 0.0]


def not_a_number(completions, **kwargs):
    return [0.0, "high", 1.0]


def infinite(completions, **kwargs):
    return [math.inf, 0.0, 1.0]


def raises_on_seven(completions, answer, **kwargs):
    return [1.0 / (int(a) - 7) for a in answer]


@pytest.mark.parametrize(
    ("fn", "expect"),
    [
        ("wrong_count", r"reward\.functions\[0\] \(wrong_count\) returned 2 scores for 3"),
        ("not_a_number", r"returned 'high' \(str\) for completion 1"),
        ("infinite", r"returned inf \(float\) for completion 0"),
    ],
)
def test_bad_scores_are_one_paragraph(fn: str, expect: str) -> None:
    rewards = build_rewards([{"_target_": f"{__name__}.{fn}", "name": fn}])
    with pytest.raises(RewardFailed) as err:
        rewards.score(["p"] * 3, ["a", "b", "c"], [[1], [2], [3]], [{}] * 3)
    assert re.search(expect, str(err.value)) and "\n" not in str(err.value)


def test_a_raising_reward_names_its_row_and_shows_its_traceback_once() -> None:
    rewards = build_rewards([{"_target_": f"{__name__}.raises_on_seven"}])
    rows = [{"answer": "3"}, {"answer": "7"}, {"answer": "9"}]
    with pytest.raises(RewardFailed) as err:
        rewards.score(["what is 3+4?"] * 3, ["x", "y", "z"], [[1], [2], [3]], rows)
    paragraph, _, trace = str(err.value).partition("\n\n")
    assert "reward.functions[0] (raises_on_seven) raised ZeroDivisionError" in paragraph
    assert "'answer': '7'" in paragraph and "'y'" in paragraph and "what is 3+4?" in paragraph
    assert trace.count("Traceback (most recent call last)") == 1
    assert "raises_on_seven" in trace and "\n" not in paragraph


def test_bad_entries_name_their_key() -> None:
    with pytest.raises(ConfigError, match=r"reward\.functions\[0\]\.patern"):
        build_rewards([{"_target_": "trainer.rollout.rewards.format_match", "patern": "x"}])
    with pytest.raises(ConfigError, match=r"reward\.functions\[1\]\._target_"):
        build_rewards(
            [{"_target_": "trainer.rollout.rewards.exact_answer"}, {"_target_": "nopkg.fn"}]
        )
    with pytest.raises(ConfigError, match=r"reward\.functions\[0\]\.weight"):
        build_rewards([{"_target_": "trainer.rollout.rewards.exact_answer", "weight": "high"}])
    with pytest.raises(ConfigError, match=r"names must differ"):
        build_rewards([{"_target_": "trainer.rollout.rewards.exact_answer"}] * 2)


def test_a_received_checkpoints_reward_target_crosses_the_trust_boundary() -> None:
    """The trust check walks every `_target_` of a saved config: a reward function is one."""
    saved = {"reward": {"functions": [{"_target_": "evilpkg.rewards.score", "weight": 1.0}]}}
    with pytest.raises(UntrustedConfigError) as err:
        check_targets(saved, Path("ckpt"), config_dir=CONFIGS)
    assert "reward.functions[0]._target_" in str(err.value) and "trust=[evilpkg]" in str(err.value)
    check_targets(saved, Path("ckpt"), config_dir=CONFIGS, trust=["evilpkg"])
    check_targets(
        saved,
        Path("ckpt"),
        config_dir=CONFIGS,
        overrides=["reward.functions.0._target_=evilpkg.rewards.score"],
    )
