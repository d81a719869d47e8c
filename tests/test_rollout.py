"""Rollouts (trainer/rollout/): a completion's tokens are a function of (seed, step, prompt,
completion index) only. The same prompts generated in other orders and other splits over
"ranks" give the same tokens, bit for bit, with transformers' generate (KV cache) and with the
recomputing decoder (the in-tree GPT); the KV cache samples what recomputing samples (float64
Llama); Gumbel-max with temperature and top-p samples the filtered softmax (frequencies of
20,000 rows within 4 standard errors); generation runs in eval mode (dropout off) and gives
every module its mode back; a pretrained model's generation_config changes nothing; lengths
stop at the first end token, and a completion without one is truncated; vLLM is refused in one
paragraph on a machine without CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from trainer.config.errors import ConfigError
from trainer.models.gpt import GPT
from trainer.rollout.engines import (
    RecomputeEngine,
    TransformersEngine,
    VLLMEngine,
    generation_engine,
)
from trainer.rollout.sampling import GumbelSampler, Sampling, completion_seeds, nucleus

transformers = pytest.importorskip("transformers")

G = 4
SEED = 7
SAMPLING = Sampling(max_new_tokens=8, eos_ids=(3,), temperature=0.9, top_p=0.95)


def tiny_llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    from trainer.models.hf import causal_lm

    torch.manual_seed(0)
    config = {
        "vocab_size": 40,
        "max_position_embeddings": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "use_cache": False,
    }
    return causal_lm("llama", config).to(dtype)


def tiny_gpt(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=16, dropout=dropout)


PROMPTS = [torch.tensor(p) for p in ([5, 9, 11], [7, 8, 2, 30, 4, 12], [21], [14, 15, 16, 17])]


def generate(engine, model, keys: Sequence[int], step: int = 3) -> dict[int, torch.Tensor]:
    """Each prompt of `keys`, in that order: its completions' tokens."""
    out = {}
    for key in keys:
        seeds = completion_seeds(SEED, step, key, G)
        out[key] = engine.generate(model, PROMPTS[key], seeds, SAMPLING).tokens
    return out


ENGINES = {
    "transformers": (TransformersEngine, tiny_llama),
    "recompute": (RecomputeEngine, tiny_gpt),
}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_tokens_do_not_depend_on_order_or_split(name: str) -> None:
    """All prompts in order on one 'rank', or reversed and split over two: the same tokens."""
    engine_cls, build = ENGINES[name]
    model = build()
    whole = generate(engine_cls(), model, [0, 1, 2, 3])
    rank0 = generate(engine_cls(), model, [3, 1])
    rank1 = generate(engine_cls(), build(), [2, 0])  # another copy of the model: another rank
    for key, tokens in {**rank0, **rank1}.items():
        assert torch.equal(tokens, whole[key]), key
    # The streams are really random: another step or another completion index draws others.
    again = generate(engine_cls(), model, [1], step=4)[1]
    assert not torch.equal(again, whole[1])
    assert len({tuple(r.tolist()) for r in whole[1]}) > 1


def test_the_kv_cache_samples_what_recomputing_samples() -> None:
    """float64 Llama: transformers' generate with its cache and the recomputing decoder give
    the same tokens for the same seeds (the sampler is the only processor: greedy over it)."""
    model = tiny_llama(torch.float64)
    cached = generate(TransformersEngine(), model, [0, 1, 2, 3])
    recomputed = generate(RecomputeEngine(), model, [0, 1, 2, 3])
    for key in cached:
        assert torch.equal(cached[key], recomputed[key]), key


def test_a_pretrained_generation_config_changes_nothing() -> None:
    """A model's own generation_config (a repetition penalty, sampling settings) is set aside
    for the call, and put back."""
    model = tiny_llama()
    plain = generate(TransformersEngine(), model, [1, 3])
    own = transformers.GenerationConfig(
        do_sample=True, temperature=0.3, top_k=2, repetition_penalty=5.0, no_repeat_ngram_size=1
    )
    model.generation_config = own
    assert generate(TransformersEngine(), model, [1, 3]).keys() == plain.keys()
    for key, tokens in generate(TransformersEngine(), model, [1, 3]).items():
        assert torch.equal(tokens, plain[key]), key
    assert model.generation_config is own


def test_generation_is_in_eval_mode_and_modes_are_restored() -> None:
    """Dropout 0.5 in train mode: the same tokens twice (dropout off), equal to the model in
    eval mode's; every module's mode given back (one left in eval stays so)."""
    model = tiny_gpt(dropout=0.5).train()
    model.blocks[0].eval()
    first = generate(RecomputeEngine(), model, [0, 1])
    assert model.training and not model.blocks[0].training and model.blocks[1].training
    second = generate(RecomputeEngine(), model, [0, 1])
    evaluated = generate(RecomputeEngine(), model.eval(), [0, 1])
    for key in first:
        assert torch.equal(first[key], second[key]) and torch.equal(first[key], evaluated[key])


def test_gumbel_max_samples_the_filtered_softmax() -> None:
    """20,000 rows of the same logits, each its own stream: the frequencies of the tokens are
    softmax(logits / T) over the top-p set, within 4 standard errors; tokens outside it never."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    rows = 20000
    sampling = Sampling(max_new_tokens=1, eos_ids=(0,), temperature=0.7, top_p=0.9)
    sampler = GumbelSampler(completion_seeds(1, 0, 0, rows), sampling, torch.device("cpu"))
    drawn = sampler.next_tokens(logits.expand(rows, -1))
    probs = (logits[0].double() / 0.7).softmax(-1)
    cum = probs.cumsum(0) - probs
    kept = cum < 0.9  # the smallest set reaching 0.9
    want = torch.where(kept, probs, 0.0) / probs[kept].sum()
    counts = torch.bincount(drawn, minlength=6).double() / rows
    for k in range(6):
        se = math.sqrt(float(want[k] * (1 - want[k])) / rows)
        assert abs(float(counts[k] - want[k])) <= 4 * se + 1e-12, (k, counts, want)
    assert not kept.all() and counts[~kept].sum() == 0
    assert torch.equal(nucleus(logits, 1.0), logits)


def test_lengths_stop_at_the_first_end_token_and_truncation_is_flagged() -> None:
    model = tiny_gpt()
    prompt, seeds = PROMPTS[0], completion_seeds(SEED, 0, 0, G)
    every_token_ends = Sampling(max_new_tokens=5, eos_ids=tuple(range(40)))
    out = RecomputeEngine().generate(model, prompt, seeds, every_token_ends)
    assert out.lengths.tolist() == [1] * G and not out.truncated.any()
    never = Sampling(max_new_tokens=5, eos_ids=(99,))  # not in the 40 tokens: never drawn
    for engine, of in ((TransformersEngine(), tiny_llama()), (RecomputeEngine(), model)):
        out = engine.generate(of, prompt, seeds, never)
        assert out.lengths.tolist() == [5] * G and out.truncated.all()
        assert out.tokens.shape == (G, 5)


def test_engine_choice_and_vllm_refused_without_cuda() -> None:
    assert isinstance(generation_engine(None, tiny_llama()), TransformersEngine)
    assert isinstance(generation_engine(None, tiny_gpt()), RecomputeEngine)
    with pytest.raises(ConfigError, match=r"rollout\.engine"):
        generation_engine("beam", tiny_gpt())
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the refusal is of machines without one")
    with pytest.raises(ConfigError) as err:
        VLLMEngine()
    text = str(err.value)
    assert "rollout.engine" in text and "CUDA" in text and "\n" not in text
