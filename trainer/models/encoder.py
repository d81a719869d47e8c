"""`model=hf_encoder`: a Hugging Face transformers encoder (BERT and its kin) that embeds
each row as the mean of its last hidden states over the attention mask.

Built at random init from `config` (fields of the family's config: `hidden_size`,
`num_hidden_layers`, ...; no download), or loaded from a local `save_pretrained` directory
with `pretrained=DIR` (its architecture and values; of `config` only runtime fields, such as
dropout, apply over the directory's: trainer/config/pretrained.py). The model is
the family's base model class (`BertModel`...) subclassed only to pool in `forward`: its
parameter names are transformers' own, so `scripts/export_hf.py` writes a directory that
`AutoModel.from_pretrained` (and sentence-transformers, with mean pooling) loads. No pooler
layer is built: mean pooling does not use it, and a parameter without gradient would stall
data-parallel training. Its blocks for FSDP and activation checkpointing are transformers'
`_no_split_modules`.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.config.pretrained import refuse_architecture
from trainer.models.hf import load_config, no_progress_bars, require_transformers

EXTRA = "hf"
POOLER = r"(^|\.)pooler\."  # the pooler's weights in a saved state dict
# sentence-transformers' files that make an exported directory load with the same pooling.
ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]


class MeanPooling:
    """`forward(input_ids, attention_mask)` -> (rows, hidden): the mean of the last hidden
    states over the positions the mask keeps (fp32, float64 for a float64 model)."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = super().forward(  # type: ignore[misc]
            input_ids=input_ids, attention_mask=attention_mask, **kwargs
        )[0]  # (rows, length, hidden)
        wide = hidden if hidden.dtype == torch.float64 else hidden.float()
        mask = attention_mask.to(wide.dtype).unsqueeze(-1)  # (rows, length, 1)
        return (wide * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)

    @property
    def max_seq_len(self) -> int | None:
        value = getattr(self.config, "max_position_embeddings", None)  # type: ignore[attr-defined]
        return value if isinstance(value, int) else None

    def save_encoder(self, out: Path) -> None:
        """`save_pretrained`, plus sentence-transformers' description of the mean pooling."""
        self.save_pretrained(out)  # type: ignore[attr-defined]
        (out / "modules.json").write_text(json.dumps(ST_MODULES, indent=2))
        (out / "1_Pooling").mkdir(exist_ok=True)
        pooling = {
            "word_embedding_dimension": int(self.config.hidden_size),  # type: ignore[attr-defined]
            "pooling_mode_mean_tokens": True,
        }
        (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
        limit = self.max_seq_len
        st = {"max_seq_length": limit, "do_lower_case": False}
        (out / "sentence_bert_config.json").write_text(json.dumps(st, indent=2))


@functools.cache
def _pooling(cls: type) -> type:
    """`cls` with mean pooling; a module-level name so pickling and FSDP see a real class."""
    # The pooler of a BERT-like directory is left out knowingly (no pooling layer is built):
    # transformers then reports its weights as unexpected at every load, start and export alike.
    # Any other weight that does not fit is still reported.
    ignored = [*(cls._keys_to_ignore_on_load_unexpected or ()), POOLER]
    body = {
        "__module__": __name__,
        "transformers_class": cls,  # export_line names it
        "_keys_to_ignore_on_load_unexpected": ignored,
    }
    sub = type(f"CumulusEncoder{cls.__name__}", (MeanPooling, cls), body)
    globals()[sub.__name__] = sub
    return sub


def encoder(
    family: str = "bert",
    config: dict[str, Any] | None = None,
    pretrained: str | None = None,
) -> nn.Module:
    """A transformers encoder with mean pooling: `family` a `model_type` (bert, roberta,
    ...) with `config` its config fields (random init), or `pretrained` a local
    `save_pretrained` directory (of `config`, runtime fields apply over its values)."""
    require_transformers()
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    config = dict(config or {})
    if pretrained is not None:  # the architecture is the directory's
        refuse_architecture(config, pretrained)
    hf_config = load_config(family, config, pretrained)
    try:
        cls = MODEL_MAPPING[type(hf_config)]
    except KeyError:
        raise ValueError(
            f"family: transformers has no base model for model_type {hf_config.model_type!r}"
        ) from None
    if getattr(hf_config, "is_decoder", False) or not hasattr(hf_config, "hidden_size"):
        raise ValueError(
            f"family: model=hf_encoder takes a BERT-like encoder config (hidden_size, "
            f"bidirectional attention); model_type {hf_config.model_type!r} is not one"
        )
    model_cls = _pooling(cls)
    # No pooler: mean pooling leaves it without gradient (DDP would wait for it).
    extra = {"add_pooling_layer": False} if _takes(cls, "add_pooling_layer") else {}
    if pretrained is not None:
        with no_progress_bars():
            model = model_cls.from_pretrained(
                Path(pretrained).expanduser(),
                config=hf_config,
                dtype=torch.float32,
                trust_remote_code=False,
                **extra,
            ).train()  # from_pretrained returns it in eval mode: dropout off
    else:
        model = model_cls(hf_config, **extra)
    model.config.architectures = [cls.__name__]  # what save_pretrained records
    model.vocab_size = int(hf_config.vocab_size)  # what the trainer checks the data against
    return model


def _takes(cls: type, name: str) -> bool:
    try:
        return name in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


SPECIAL_TOKENS = {
    "unk_token": ("[UNK]", "<unk>"),
    "pad_token": ("[PAD]", "<pad>"),
    "cls_token": ("[CLS]", "<s>"),
    "sep_token": ("[SEP]", "</s>"),
    "mask_token": ("[MASK]", "<mask>"),
}


def encoder_tokenizer(path: str) -> Any:
    """The run's tokenizer (a tokenizer.json, or a directory holding one) as a
    `PreTrainedTokenizerFast` with the special tokens its vocabulary has (BERT's or
    RoBERTa's names), for an exported encoder directory: `AutoTokenizer` loads it, and its
    padding token lets sentence-transformers batch texts."""
    transformers = require_transformers()
    from trainer.data.tokenize import load_tokenizer

    tok = load_tokenizer(path, key="data.tokenizer")
    special = {
        role: next(name for name in names if tok.token_to_id(name) is not None)
        for role, names in SPECIAL_TOKENS.items()
        if any(tok.token_to_id(name) is not None for name in names)
    }
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)
