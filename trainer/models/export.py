"""What a trained model becomes in a Hugging Face directory (`scripts/export_hf.py`).

- A transformers model (`model=hf_gpt2|hf_llama`) is its own class: `save_pretrained`.
- The in-tree GPT (`trainer.models.gpt.GPT`) is a GPT-2-style decoder (pre-norm blocks, fused
  q/k/v, exact GELU, learned positions, tied embeddings), so it becomes transformers'
  `GPT2LMHeadModel` with its weights mapped: nn.Linear's (out, in) weights transposed into
  GPT-2's Conv1D (in, out), `bias=false` as zero biases, `fake_quant_bits` as the quantized
  weights its forward uses, `activation_function="gelu"` (not GPT-2's tanh approximation).
  Its logits are cumulus's to fp32 round-off.
- Anything else (the CNN of `experiment=digits`, a model of your own) has no mapping;
  `export_support` says so, for the start of a run and for the export's refusal.

Beside the weights goes a tokenizer: the run's `data.tokenizer`, or for byte-level text (the
default data) one that maps each UTF-8 byte to its own id, as cumulus's data does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.models.hf import is_transformers_model

GPT_TARGET = "trainer.models.gpt.GPT"
EXTRA = "hf"
# data targets whose text, without data.tokenizer, is UTF-8 bytes (ids 0-255)
BYTE_TEXT = ("trainer.data.text.text_data", "trainer.data.hf.hf_data")


def _is_gpt(model: nn.Module) -> bool:
    from trainer.models.gpt import GPT

    return isinstance(model, GPT)


def export_support(model: nn.Module) -> str | None:
    """None when `scripts/export_hf.py` can export `model`, else why not (one sentence)."""
    if is_transformers_model(model) or _is_gpt(model):
        return None
    return (
        f"a {type(model).__name__} has no Hugging Face architecture to map to: "
        "scripts/export_hf.py exports the in-tree GPT (model=gpt_small|gpt_tiny, as "
        "GPT2LMHeadModel) and transformers models (model=hf_gpt2|hf_llama); the checkpoint's "
        "state.pt still holds the weights under the model's own parameter names"
    )


def export_line(model: nn.Module) -> str:
    """One line for a run's header: what `scripts/export_hf.py` will make of this model."""
    if export_support(model) is not None:
        return (
            f"export: scripts/export_hf.py cannot export a {type(model).__name__} (no Hugging "
            "Face architecture to map it to; it exports the in-tree GPT and transformers models)"
        )
    kind = "GPT2LMHeadModel"
    if is_transformers_model(model):
        kind = getattr(type(model), "transformers_class", type(model)).__name__
    return f"export: scripts/export_hf.py writes it as transformers' {kind}"


def saved_architecture(out: Path, fallback: str) -> str:
    """The architecture `out/config.json` names (what `AutoModel...from_pretrained` builds), for
    the export's console line; `fallback` where the file names none. cumulus's own subclasses
    of transformers models save their transformers class there (trainer/models/hf.py)."""
    import json

    try:
        names = json.loads((out / "config.json").read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError):
        return fallback
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else fallback


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        from trainer.config.errors import UserError

        raise UserError(f"exporting needs transformers; pip install 'cumulus[{EXTRA}]'") from None
    return transformers


def gpt2_config(model: nn.Module, eos_id: int | None = None) -> Any:
    """transformers' `GPT2Config` with the in-tree GPT's shapes and behaviour."""
    cfg = model.cfg
    return _transformers().GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=4 * cfg.n_embd,
        activation_function="gelu",  # F.gelu, exact (GPT-2's own is the tanh approximation)
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default
        scale_attn_weights=True,  # 1/sqrt(head size), as scaled_dot_product_attention
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        architectures=["GPT2LMHeadModel"],
    )


def _weight(linear: nn.Linear) -> torch.Tensor:
    """The weight the layer's forward uses (fake-quantized ones quantized), as Conv1D's
    (in, out)."""
    w = linear.weight.detach()
    bits = getattr(linear, "bits", None)
    if bits is not None:
        from engine.numerics.functional import fake_quantize

        w = fake_quantize(w, bits)
    return w.t()


def _bias(module: nn.Module, size: int, like: torch.Tensor) -> torch.Tensor:
    bias = getattr(module, "bias", None)
    return torch.zeros(size, dtype=like.dtype, device=like.device) if bias is None else bias


def gpt2_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The in-tree GPT's weights under GPT2LMHeadModel's names and layouts."""
    c = model.cfg.n_embd
    ref = model.tok_emb.weight
    out = {
        "transformer.wte.weight": model.tok_emb.weight.detach(),
        "transformer.wpe.weight": model.pos_emb.weight.detach(),
        "transformer.ln_f.weight": model.ln_f.weight.detach(),
        "transformer.ln_f.bias": _bias(model.ln_f, c, ref).detach(),
    }
    for i, block in enumerate(model.blocks):
        h = f"transformer.h.{i}."
        layers = {
            "attn.c_attn": (block.attn.qkv, 3 * c),  # [q | k | v] in both
            "attn.c_proj": (block.attn.proj, c),
            "mlp.c_fc": (block.mlp.fc, 4 * c),
            "mlp.c_proj": (block.mlp.proj, c),
        }
        for name, (linear, n_out) in layers.items():
            out[f"{h}{name}.weight"] = _weight(linear)
            out[f"{h}{name}.bias"] = _bias(linear, n_out, ref).detach()
        for name, norm in (("ln_1", block.ln1), ("ln_2", block.ln2)):
            out[f"{h}{name}.weight"] = norm.weight.detach()
            out[f"{h}{name}.bias"] = _bias(norm, c, ref).detach()
    return out


def to_gpt2(model: nn.Module, eos_id: int | None = None) -> Any:
    """A `GPT2LMHeadModel` computing the in-tree GPT's logits (fp32 round-off)."""
    transformers = _transformers()
    hf = transformers.GPT2LMHeadModel(gpt2_config(model, eos_id)).to(model.tok_emb.weight.dtype)
    weights = gpt2_state_dict(model)
    params = dict(hf.named_parameters())  # lm_head.weight is wte's: one parameter, one name
    missing = set(params) - set(weights)
    if missing:  # a transformers version that renamed GPT-2's parameters
        raise RuntimeError(f"GPT2LMHeadModel parameters with no GPT weight: {sorted(missing)}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.device))
    hf.tie_weights()
    return hf.eval()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: a printable character for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def byte_tokenizer() -> Any:
    """A `tokenizers.Tokenizer` whose ids are UTF-8 bytes (0-255), as cumulus's byte-level
    data: byte-level pre-tokenization and a BPE with one entry per byte and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_text(data: dict[str, Any]) -> bool:
    """The run's data were UTF-8 bytes: text or records with no tokenizer, not token .bin."""
    if data.get("tokenizer") or data.get("_target_") not in BYTE_TEXT:
        return False
    path = Path(str(data.get("path") or ""))
    return path.suffix != ".bin" and not (path / "train.bin").exists()


def run_tokenizer(data: dict[str, Any]) -> tuple[Any, str]:
    """(a transformers tokenizer for the run's data or None, what it is). Loaded before
    anything is written: a bad tokenizer leaves no half-written export.

    A transformers tokenizer directory (`data.tokenizer=DIR`, or the `model.pretrained`
    directory's, with its tokenizer_config.json) is loaded and saved as it is: its special
    tokens, added tokens and chat template come out unchanged; with
    `data.chat_template=FILE` that template, which training rendered with, is the export's.
    A bare tokenizer.json (or a directory of one alone) gets its end-of-text token as eos.
    """
    transformers = _transformers()  # first: without the extra, one line naming it
    from trainer.data.tokenize import tokenizer_source

    source = tokenizer_source(data.get("tokenizer"), data.get("pretrained"))
    template = data.get("chat_template")
    if source and (Path(source).expanduser() / "tokenizer_config.json").is_file():
        from trainer.data.tokenize import load_hf_tokenizer

        tok = load_hf_tokenizer(source, "data.tokenizer")
        if template:
            tok.chat_template = Path(str(template)).expanduser().read_text(encoding="utf-8")
        return tok, f"the run's tokenizer ({source})" + (f", template {template}" * bool(template))
    if source:
        from trainer.data.tokenize import eos_id, load_tokenizer

        tok = load_tokenizer(str(source))
        eos = eos_id(tok)
        name = None if eos is None else tok.id_to_token(eos)
        what = f"the run's tokenizer ({source})"
    elif _byte_text(data):
        tok, name, what = byte_tokenizer(), None, "a byte-level tokenizer (ids = UTF-8 bytes)"
    else:
        return None, "no tokenizer: the run's data were token ids with no data.tokenizer"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=name)
    if template:
        fast.chat_template = Path(str(template)).expanduser().read_text(encoding="utf-8")
    return fast, what
