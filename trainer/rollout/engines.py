"""Generation engines: one interface, `GenerationEngine.generate(model, prompt_ids, seeds,
sampling)`, that turns one prompt into its G completions (G = len(seeds)).

- `TransformersEngine`: transformers' `generate` with its KV cache, greedy decoding over our
  `GumbelSampler` (trainer/rollout/sampling.py) as its only logits processor: the model's own
  `generation_config` (a pretrained model's temperature, top-p, repetition penalty...) is set
  aside for the call, so nothing but `Sampling` decides the distribution.
- `RecomputeEngine`: any model that returns logits for `input_ids` (the in-tree GPT): each
  step runs the whole sequence again (no cache: the in-tree GPT is small; its attention has no
  cache to keep), the same sampler.
- `VLLMEngine`: the slot for vLLM (colocated, GPU); refused without CUDA or vLLM.

Mode: generation runs with every module in eval mode (dropout off: the completions are
samples of the policy itself, as vLLM's, which has no dropout) under `torch.no_grad`, each
module's own mode restored after. TRL's transformers path generates with the model in
whatever mode training left it (dropout on, unless `disable_dropout`); its vLLM path has none.
The training forward then runs in train mode; at the first iteration the old policy is that
forward's own detached log-probabilities, so the ratio is exactly 1 either way.

`synced_ranks`: on a layout whose forward is collective (FSDP2 gathers each block's
parameters), every rank must run as many forwards: every rank makes the same number of calls
(the same number of prompts), and within a call a rank whose rows have all ended keeps
stepping until every rank's have (transformers' `synced_gpus`; `RecomputeEngine` then always
runs `max_new_tokens` steps). The extra steps draw no token for the finished rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from engine.distributed import unwrap
from engine.tasks import logits_of
from trainer.config.errors import ConfigError
from trainer.rollout.sampling import GumbelSampler, Sampling


@dataclass(frozen=True)
class Completions:
    """A prompt's completions: `tokens` (G, L) (`pad_id` after each one's end), `lengths`
    (G,) (through the first end token), `truncated` (G,) (no end token: cut at the limit)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor


def completions_of(generated: torch.Tensor, sampling: Sampling) -> Completions:
    """The completions of generated ids (G, n): each cut after its first end token."""
    ends = torch.isin(generated, torch.tensor(sampling.eos_ids, device=generated.device))
    ended = ends.any(-1)
    first = torch.where(ended, ends.int().argmax(-1), generated.shape[-1] - 1)
    lengths = torch.where(ended, first + 1, generated.shape[-1])
    keep = torch.arange(generated.shape[-1], device=generated.device) < lengths[:, None]
    tokens = torch.where(keep, generated, sampling.pad_id)
    return Completions(tokens, lengths, ~ended)


@contextlib.contextmanager
def generating(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode and no autograd; each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


class GenerationEngine(Protocol):
    """What turns a prompt into its completions (`rollout.engine`)."""

    name: ClassVar[str]

    def generate(
        self, model: nn.Module, prompt_ids: torch.Tensor, seeds: Sequence[int], sampling: Sampling
    ) -> Completions:
        """The completions of `prompt_ids` (P,), one per seed (trainer/rollout/sampling.py's
        `completion_seeds`), as `model` (maybe laid out over ranks) samples them."""
        ...


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class TransformersEngine:
    """transformers' `generate` (KV cache), sampling by `GumbelSampler`."""

    name = "transformers"

    def __init__(self, synced_ranks: bool = False) -> None:
        self.synced_ranks = synced_ranks

    def generate(
        self, model: nn.Module, prompt_ids: torch.Tensor, seeds: Sequence[int], sampling: Sampling
    ) -> Completions:
        from transformers import LogitsProcessorList

        inner = unwrap(model)  # DDP's wrapper takes no generate; FSDP2 shards in place
        device = _device_of(inner)
        ids = prompt_ids.to(device).expand(len(seeds), -1).contiguous()  # (G, P)
        sampler = GumbelSampler(seeds, sampling, device)
        with generating(inner), _own_generation_config(inner):
            # Settings as arguments over transformers' defaults (no config object: cumulus'
            # models take max_new_tokens as an argument, to stop at their context).
            out = inner.generate(
                ids,
                max_new_tokens=sampling.max_new_tokens,
                attention_mask=torch.ones_like(ids),
                do_sample=False,  # greedy over the sampler's perturbed scores: its sample
                num_beams=1,
                eos_token_id=list(sampling.eos_ids),
                pad_token_id=sampling.pad_id,
                use_cache=True,
                logits_processor=LogitsProcessorList([sampler]),
                synced_gpus=self.synced_ranks,
            )
        return completions_of(out[:, ids.shape[1] :], sampling)


@contextlib.contextmanager
def _own_generation_config(model: Any) -> Iterator[None]:
    """The model's `generation_config` replaced by transformers' defaults for the call: a
    pretrained model's would fill every setting ours leaves unset (a repetition penalty, say)."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class RecomputeEngine:
    """Any model returning logits for `input_ids`: the whole sequence each step, no cache."""

    name = "recompute"

    def __init__(self, synced_ranks: bool = False) -> None:
        self.synced_ranks = synced_ranks

    def generate(
        self, model: nn.Module, prompt_ids: torch.Tensor, seeds: Sequence[int], sampling: Sampling
    ) -> Completions:
        device = _device_of(model)
        ids = prompt_ids.to(device).expand(len(seeds), -1).contiguous()  # (G, P)
        sampler = GumbelSampler(seeds, sampling, device)
        eos = torch.tensor(sampling.eos_ids, device=device)
        running = torch.ones(len(seeds), dtype=torch.bool, device=device)
        generated = []
        with generating(model):
            for _ in range(sampling.max_new_tokens):
                logits = logits_of(model(input_ids=ids), "rollout.engine=recompute")[:, -1]
                nxt = sampler.next_tokens(logits)  # (G,): every row draws, finished ones too
                nxt = torch.where(running, nxt, sampling.pad_id)
                generated.append(nxt)
                ids = torch.cat([ids, nxt[:, None]], dim=1)
                running &= ~torch.isin(nxt, eos)
                if not self.synced_ranks and not bool(running.any()):
                    break
        return completions_of(torch.stack(generated, 1), sampling)


class VLLMEngine:
    """vLLM, colocated on the training GPUs: the slot is declared; it needs CUDA and vLLM."""

    name = "vllm"

    def __init__(self, synced_ranks: bool = False) -> None:
        del synced_ranks
        import importlib.util

        missing = [
            what
            for what, ok in (
                ("a CUDA device", torch.cuda.is_available()),
                ("the vllm package", importlib.util.find_spec("vllm") is not None),
            )
            if not ok
        ]
        if missing:
            raise ConfigError(
                "rollout.engine",
                f"vllm generates on the training GPUs with vLLM, and this machine has no "
                f"{' and no '.join(missing)}. Use rollout.engine=transformers (transformers' "
                "generate with its KV cache, any device) or rollout.engine=recompute (a model "
                "that returns logits, such as the in-tree GPT)",
            )
        raise ConfigError(
            "rollout.engine",
            "vllm is not built yet in this version: its weight sync from the laid-out policy "
            "is to come. Use rollout.engine=transformers",
        )

    def generate(
        self, model: nn.Module, prompt_ids: torch.Tensor, seeds: Sequence[int], sampling: Sampling
    ) -> Completions:
        raise NotImplementedError  # refused at construction


ENGINES: dict[str, type] = {e.name: e for e in (TransformersEngine, RecomputeEngine, VLLMEngine)}


def generation_engine(name: str | None, model: nn.Module, synced_ranks: bool = False) -> Any:
    """`rollout.engine=name`; None: transformers' for a transformers model, else recompute."""
    if name is None:
        from transformers import GenerationMixin

        name = "transformers" if isinstance(unwrap(model), GenerationMixin) else "recompute"
    if name not in ENGINES:
        raise ConfigError("rollout.engine", f"valid: {', '.join(ENGINES)} or null; got {name!r}")
    return ENGINES[name](synced_ranks=synced_ranks)
