"""Prompt rows for the data=prompts and task=grpo tests: two-digit sums with their answers,
half of them a plain string (one user message), half a list of messages with a system one."""

from __future__ import annotations

import random
from typing import Any


def prompt_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"what is {a} + {b}?"
        if i % 2:
            prompt: Any = [
                {"role": "system", "content": "answer with a number"},
                {"role": "user", "content": question},
            ]
        else:
            prompt = question
        rows.append({"prompt": prompt, "answer": str(a + b), "level": i % 3})
    return rows
