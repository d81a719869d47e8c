"""Support for tests/test_cached.py and scripts/bench_cached.py: a tiny word-level tokenizer
with BERT's special tokens, (anchor, positive) pairs that share words, a tiny BERT config,
and callbacks the trainer loads by `_target_` (gradients before the update, the
representations of both passes).

Imports stay cheap: the trainer's subprocesses import this module to build the callbacks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from engine.callbacks import Callback
from engine.contrastive import ContrastiveTask
from engine.distributed import unwrap
from engine.parallel.base import whole_tensor

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(59)]  # 64 ids in all
# A 2-layer BERT of width 32 (random init): model=hf_encoder's model.config.*.
TINY_BERT = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
}


def tiny_bert(dropout: float = 0.0) -> list[str]:
    """Overrides selecting model=hf_encoder at TINY_BERT's shapes."""
    out = ["model=hf_encoder"]
    out += [f"model.config.{k}={v}" for k, v in TINY_BERT.items()]
    out += [
        f"model.config.hidden_dropout_prob={dropout}",
        f"model.config.attention_probs_dropout_prob={dropout}",
    ]
    return out


def write_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer.json (whitespace words, [CLS] text [SEP]) in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` rows: an anchor of 3-9 words and a positive sharing about half of them, so that
    the texts differ in length within a micro-batch (padding)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        anchor = rng.choices(WORDS, k=rng.randint(3, 9))
        positive = [w for w in anchor if rng.random() < 0.5] + rng.choices(WORDS, k=2)
        rng.shuffle(positive)
        rows.append({"anchor": " ".join(anchor), "positive": " ".join(positive)})
    return rows


def write_pairs(path: Path, n: int, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in pairs(n, seed)))
    return path


class DumpWholeGrads(Callback):
    """Before optimizer step `step` (1-based): every parameter's gradient, whole (FSDP's
    shards gathered: collective, every rank takes part), saved by rank 0 to `path`."""

    def __init__(self, path: str, step: int = 1) -> None:
        self.path, self.step = Path(path), step

    def on_before_optimizer_step(self, ctx: Any) -> None:
        if ctx.step + 1 != self.step:
            return
        grads = {
            name: whole_tensor(p.grad).detach().clone()
            for name, p in unwrap(ctx.model).named_parameters()
            if p.grad is not None
        }
        if ctx.dist.rank == 0:
            torch.save(grads, self.path)


class RecordingContrastive(ContrastiveTask):
    """task=contrastive that keeps every representation it computes (in call order) and
    saves them to `path` after each call: pass 1's then pass 2's of each window."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = Path(path)
        self.calls: list[dict[str, Any]] = []

    def represent(self, model: Any, batch: Any) -> torch.Tensor:
        reps = super().represent(model, batch)
        self.calls.append({"grad": torch.is_grad_enabled(), "reps": reps.detach().clone()})
        torch.save(self.calls, self.path)
        return reps


def limited_encoder(fit: int = 1_000_000, **encoder_args: Any) -> torch.nn.Module:
    """model=hf_encoder that runs out of memory (a real `torch.OutOfMemoryError`) when a
    training forward with gradients holds more than `fit` pairs (2 x `fit` rows): pass 2 and
    the auto micro-batch's probe, never pass 1 (no gradients)."""
    from trainer.models.encoder import encoder

    model = encoder(**encoder_args)
    model.fit = fit  # type: ignore[assignment]

    def check(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        rows = kwargs["input_ids"].shape[0]
        if module.training and torch.is_grad_enabled() and rows > 2 * module.fit:
            raise torch.OutOfMemoryError(f"test limit: {rows // 2} pairs > {module.fit}")

    model.register_forward_pre_hook(check, with_kwargs=True)
    return model


class LowerLimit(Callback):
    """After optimizer step `at_step`, the limited encoder's limit becomes `fit` pairs."""

    def __init__(self, at_step: int, fit: int) -> None:
        self.at_step, self.fit = at_step, fit

    def on_after_optimizer_step(self, ctx: Any, step: int) -> None:
        if step == self.at_step:
            unwrap(ctx.model).fit = self.fit
