"""Preference pairs to tune on (data=preference): what test_dpo and test_config share."""

from __future__ import annotations

import random
from typing import Any

from tests.chat_support import sentence


def pair_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` pairs in both of TRL's layouts: a string prompt with string answers, and whole
    conversations (a system message, an earlier exchange) sharing their prompt."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if i % 2:
            prompt = sentence(rng, 2, 8)
            rows.append({"prompt": prompt, "chosen": sentence(rng, 1, 6)})
            rows[-1]["rejected"] = sentence(rng, 1, 6)
            continue
        head = [{"role": "system", "content": sentence(rng, 1, 4)}] if i % 4 else []
        head += [
            {"role": "user", "content": sentence(rng, 1, 5)},
            {"role": "assistant", "content": sentence(rng, 1, 4)},
            {"role": "user", "content": sentence(rng, 1, 5)},
        ]
        answer = [{"role": "assistant", "content": sentence(rng, 1, 6)} for _ in range(2)]
        rows.append({"chosen": [*head, answer[0]], "rejected": [*head, answer[1]]})
    return rows
