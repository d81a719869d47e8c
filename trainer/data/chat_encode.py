"""The encoder of `data=chat` for the corpus machinery (trainer/data/shards.py): rows checked,
rendered with the chat template (trainer/data/chat_render.py), tokenized, and the target mask
stored beside the tokens.

Runs in the tokenizer worker processes (inherited by fork, with the tokenizer the main process
loaded). Per conversation it writes its tokens, a per-token target mask (1: a supervised token,
predicted from the token before it; this module alone decides which tokens are targets) and
two per-conversation counts that decide later, without reading the tokens again, which
conversations survive truncation: the targets and the position of the first one (-1: none).
Every row is stored; dropping is decided when the data is opened (`data.max_length`,
`data.truncation` are not part of the cache key).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.data.chat_render import Renderer, Span, default_train_on
from trainer.data.chat_rows import conversation
from trainer.data.encoding import Encoded, text_identity, tokenizer_files_identity
from trainer.data.tokenize import load_hf_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

VERSION = "chat/1"


def token_mask(offsets: np.ndarray, spans: list[Span]) -> np.ndarray:
    """(n_tokens,) uint8: 1 for the tokens from the one holding each span's first character
    through the one holding its last (`offsets`: (n_tokens, 2) character ranges)."""
    mask = np.zeros(len(offsets), np.uint8)
    if not len(offsets):
        return mask
    starts, ends = offsets[:, 0], offsets[:, 1]
    for a, b in spans:
        if b <= a:
            continue
        first = int(np.searchsorted(ends, a, side="right"))  # first token ending after a
        last = int(np.searchsorted(starts, b, side="left")) - 1  # last token starting before b
        if first <= last:
            mask[first : last + 1] = 1
    return mask


def target_mask(offsets: np.ndarray, spans: list[Span]) -> np.ndarray:
    """(n_tokens,) uint8: 1 for the supervised tokens that are targets. The first token is
    predicted from nothing: never a target."""
    mask = token_mask(offsets, spans)
    mask[:1] = 0
    return mask


@dataclass
class ChatEncoder:
    """`tokenizer`: a tokenizer directory or tokenizer.json (`tok`: it loaded, else loaded
    here); `template`: the chat template's text (`origin`: the key that chose it); `train_on`:
    what is supervised (None: by row kind)."""

    tokenizer: str
    template: str
    origin: str
    train_on: str | None
    tok: PreTrainedTokenizerFast | None = None
    extras: dict[str, tuple[str, str]] = field(
        default_factory=lambda: {
            "mask": ("token", "|u1"),
            "targets": ("doc", "<i8"),
            "first_target": ("doc", "<i8"),
        }
    )

    def __post_init__(self) -> None:
        if self.tok is None:
            self.tok = load_hf_tokenizer(self.tokenizer)
        self._renderer: Renderer | None = None

    def identity(self) -> dict[str, Any]:
        return {
            "encoder": VERSION,
            "tokenizer": tokenizer_files_identity(self.tokenizer),
            "template": text_identity(self.template),
            "train_on": self.train_on,
        }

    def vocab_size(self) -> int:
        assert self.tok is not None
        return len(self.tok)

    def start(self) -> None:
        assert self.tok is not None
        self._renderer = Renderer(self.template, dict(self.tok.special_tokens_map), self.origin)

    def supervised(self, record: dict[str, Any], where: str) -> tuple[str, list[Span]]:
        """One row's rendering and its supervised character spans (`Renderer.supervised` of
        the row read as a conversation)."""
        assert self._renderer is not None, "start() first"
        conv = conversation(record, where)
        train_on = self.train_on or default_train_on(conv)
        return self._renderer.supervised(conv, train_on, where)

    def encode(self, values: list[Any], where: list[str], ends: list[bool] | None) -> Encoded:
        del ends
        assert self.tok is not None
        rendered = [self.supervised(v, w) for v, w in zip(values, where)]
        # The Rust tokenizer on the whole chunk; as apply_chat_template tokenizes a rendering:
        # no special tokens added (the template writes its own).
        encodings = self.tok.backend_tokenizer.encode_batch(
            [text for text, _ in rendered], add_special_tokens=False
        )
        ids, masks, targets, first = [], [], [], []
        for enc, (_, spans) in zip(encodings, rendered):
            mask = target_mask(np.asarray(enc.offsets, np.int64).reshape(-1, 2), spans)
            hits = np.flatnonzero(mask)
            ids.append(np.asarray(enc.ids, np.int64))
            masks.append(mask)
            targets.append(len(hits))
            first.append(int(hits[0]) if len(hits) else -1)
        lengths = np.array([len(i) for i in ids], np.int64)
        return Encoded(
            tokens=np.concatenate(ids) if ids else np.zeros(0, np.int64),
            lengths=lengths,
            extras={
                "mask": np.concatenate(masks) if masks else np.zeros(0, np.uint8),
                "targets": np.array(targets, np.int64),
                "first_target": np.array(first, np.int64),
            },
        )


def encode_one(encoder: ChatEncoder, record: dict[str, Any], where: str = "row") -> tuple:
    """(token ids, target mask) of one row, as the shards hold them (for checks and previews)."""
    if encoder._renderer is None:
        encoder.start()
    out = encoder.encode([record], [where], None)
    return out.tokens, out.extras["mask"]
