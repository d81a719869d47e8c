"""Sampling that does not depend on the batch: each completion draws from its own stream.

A completion's tokens are a function of (seed, step, prompt, completion index) only, never of
the layout, the micro-batch size or the other prompts generated beside it. Three choices make
it so:

- one group per call: a prompt's G completions are generated together and alone, so the
  batch a row sits in is always its own group's G copies of one prompt: no padding, the same
  shapes (and so the same kernels and round-off) on any rank and in any order;
- one random stream per row: `completion_seeds` gives each completion a 64-bit seed from
  NumPy's SeedSequence of (seed, step, prompt key, completion index), and the row's own
  `torch.Generator` draws its noise every decoding step (finished rows too), so no row's draws
  depend on another's;
- Gumbel-max: temperature and top-p filter the logits, the row adds Gumbel noise
  -log(-log(u)), u ~ U(0, 1) from its own generator, and decoding takes the argmax, which is
  an exact sample from the filtered softmax (the Gumbel-max trick). transformers' greedy
  decoding then samples through `logits_processor`, with none of its own processors
  (engine: trainer/rollout/engines.py).

`temperature=0` is greedy decoding (no noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

ROLLOUT_STREAM = 0x9E0  # keeps the completion streams apart from the loader's and dropout's


def completion_seeds(seed: int, step: int, prompt_key: int, count: int) -> list[int]:
    """The seeds of a prompt's `count` completions at optimizer step `step`: one 64-bit seed
    per (seed, step, prompt key, completion index)."""
    out = []
    for index in range(count):
        words = np.random.SeedSequence([seed, step, prompt_key, index, ROLLOUT_STREAM])
        out.append(int(words.generate_state(1, np.uint64)[0]) >> 1)  # torch takes < 2**63
    return out


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn.

    Args:
        max_new_tokens: tokens generated at most per completion.
        temperature: the logits' divisor (0: greedy).
        top_p: nucleus sampling: the smallest set of tokens whose probability reaches top_p.
        eos_ids: the tokens that end a completion (it includes its end token).
        pad_id: what fills a completion after its end.
    """

    max_new_tokens: int
    eos_ids: tuple[int, ...]
    temperature: float = 1.0
    top_p: float = 1.0
    pad_id: int = 0

    def __post_init__(self) -> None:
        # Messages start with the field's name: the trainer names the config key from it.
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens > 0):
            raise ValueError(f"max_new_tokens must be a positive number, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.eos_ids:
            raise ValueError("eos_ids: a completion needs an end token; none was given")


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """(G, V) logits with every token outside each row's top-p set at -inf (the most likely
    token always kept)."""
    if top_p >= 1.0:
        return logits
    ordered, order = logits.sort(-1, descending=True)
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each one
    drop = before >= top_p
    drop[..., 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -torch.inf)


class GumbelSampler:
    """Per-row sampling by Gumbel-max, each row its own generator; as transformers'
    `LogitsProcessor` (called with the ids so far and the next-token scores, (G, V)) it
    returns scores whose argmax is the row's sample."""

    def __init__(self, seeds: Sequence[int], sampling: Sampling, device: torch.device) -> None:
        self.sampling = sampling
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        del input_ids
        return self.perturbed(scores)

    def perturbed(self, scores: torch.Tensor) -> torch.Tensor:
        """(G, V) float64: each row's filtered logits plus its Gumbel noise."""
        if len(self.generators) != scores.shape[0]:
            raise ValueError(
                f"GumbelSampler: {len(self.generators)} streams for {scores.shape[0]} rows"
            )
        t = self.sampling.temperature
        if t == 0:
            return scores
        logits = nucleus(scores.double() / t, self.sampling.top_p)  # (G, V)
        tiny = torch.finfo(torch.float64).tiny
        noise = torch.stack(
            [
                torch.rand(logits.shape[-1], generator=g, device=logits.device, dtype=torch.float64)
                for g in self.generators
            ]
        ).clamp_(min=tiny)
        return logits - (-noise.log()).log()  # + Gumbel(0, 1)

    def next_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """(G,) the rows' next tokens from their next-token logits (G, V)."""
        return self.perturbed(logits.float()).argmax(-1)
