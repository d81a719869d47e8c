"""A tiny pretrained Llama and a tokenizer that carries a chat template, built in a folder (no
download), and conversations to fine-tune it on: what the data=chat tests share.

The template is ChatML with `{% generation %}` markers around each assistant message's
content and end-of-turn token (`TEMPLATE`); `PLAIN` is the same template without them, for
the prefix method.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from engine.callbacks import Callback

TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PLAIN = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TEXT = """the a quick brown fox jumps over lazy dog hello world what is answer please
explain numbers one two three four five why how because tokens model train exact gradient
sum über café naïve 東京 ✓ ok yes no maybe"""
WORDS = _TEXT.split()
SEED = 1337
LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    # As many saved configs say: training must not build a cache (it would let packed
    # conversations attend to each other).
    "use_cache": True,
}


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversations(n: int, seed: int = 0, max_turns: int = 3) -> list[dict[str, Any]]:
    """`n` rows of messages: an optional system message, then 1..max_turns exchanges."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": sentence(rng, 2, 6)})
        for _ in range(rng.randint(1, max_turns)):
            messages.append({"role": "user", "content": sentence(rng, 2, 12)})
            messages.append({"role": "assistant", "content": sentence(rng, 1, 14)})
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def make_tokenizer(out: Path, template: str | None = TEMPLATE) -> Any:
    """A byte-level BPE (~300 tokens) with ChatML's special tokens and `template`, saved in
    `out`; returns the transformers tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(SEED)
    tok.train_from_iterator([sentence(rng, 4, 20) for _ in range(400)], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        unk_token=None,
    )
    if template is not None:
        fast.chat_template = template
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return transformers.AutoTokenizer.from_pretrained(out)


def make_llama(out: Path, vocab_size: int, seed: int = SEED) -> Path:
    """A random tiny `LlamaForCausalLM` saved as a pretrained directory (float32)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab_size, **LLAMA)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


def pretrained(root: Path, template: str | None = TEMPLATE) -> tuple[Path, Any]:
    """A pretrained directory holding the tiny Llama and its tokenizer (with `template`)."""
    out = root / "pretrained"
    tok = make_tokenizer(out, template)
    make_llama(out, len(tok))
    return out, tok


def long_prompts(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """Rows whose supervised tokens all sit in the last quarter of the conversation: a long
    system and user prompt, a one-word answer. Under dist.cp=2 a rank holds chunks 1 and 2
    of 4 of each, so none of their supervised tokens."""
    rng = random.Random(seed)
    return [
        {
            "messages": [
                {"role": "system", "content": sentence(rng, 14, 16)},
                {"role": "user", "content": sentence(rng, 14, 16)},
                {"role": "assistant", "content": rng.choice(["yes", "no", "ok"])},
            ]
        }
        for _ in range(n)
    ]


class DumpAllGrads(Callback):
    """A callback: the gradients the optimizer is about to apply at optimizer step `step`
    (1-based), written by rank 0 as {name: tensor}. Every rank calls it (FSDP2 gradients are
    gathered whole: a collective)."""

    def __init__(self, path: str, step: int = 1) -> None:
        self.path, self.step = Path(path), step

    def on_before_optimizer_step(self, ctx: Any) -> None:
        if ctx.step + 1 != self.step:
            return
        import torch

        from engine.distributed import unwrap

        grads = {}
        for name, p in unwrap(ctx.model).named_parameters():
            if p.grad is None:
                continue
            g = p.grad
            if hasattr(g, "full_tensor"):
                g = g.full_tensor()
            grads[name] = g.detach().clone().cpu()
        if ctx.dist.rank == 0:
            tmp = self.path.with_suffix(".tmp")
            torch.save(grads, tmp)
            tmp.replace(self.path)
