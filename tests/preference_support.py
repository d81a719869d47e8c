"""Preference pairs to tune on (data=preference): what test_dpo and test_config share; a
model that fits only sharded."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

from tests.chat_support import sentence
from trainer.models.gpt import GPT


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


class ShardedOnlyGPT(GPT):
    """A GPT that fits in memory only sharded: on a rank of several, a forward of the whole
    model (not laid out by FSDP2's fully_shard) runs out of memory (a real
    `torch.OutOfMemoryError`)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        several = dist.is_initialized() and dist.get_world_size() > 1
        if several and not isinstance(self, FSDPModule):
            raise torch.OutOfMemoryError("test limit: the whole model does not fit on a rank")
        return super().forward(*args, **kwargs)
