"""The encoder of `data=chat` for the corpus machinery (trainer/data/shards.py): rows checked,
rendered with the chat template, tokenized, and the supervision mask stored beside the tokens.

Runs in the tokenizer worker processes. Per conversation it writes its tokens, a per-token
mask (1: a supervised token, predicted from the token before it) and two per-conversation
counts that decide later, without reading the tokens again, which conversations survive
truncation: the supervised targets and the position of the first one (-1: none). Every row is
stored; dropping is decided when the data is opened (`data.max_length`, `data.truncation`
are not part of the cache key).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer.data.chat_render import (
    Renderer,
    default_train_on,
    directory_identity,
    load_tokenizer,
    token_mask,
)
from trainer.data.chat_rows import conversation
from trainer.data.encoding import Encoded

VERSION = "chat/1"


@dataclass
class ChatEncoder:
    """`tokenizer`: a tokenizer directory or tokenizer.json; `template`: the chat template's
    text (`origin`: the key that chose it); `train_on`: what is supervised (None: by row kind)."""

    tokenizer: str
    template: str
    origin: str
    train_on: str | None
    extras: dict[str, tuple[str, str]] = field(
        default_factory=lambda: {
            "mask": ("token", "|u1"),
            "targets": ("doc", "<i8"),
            "first_target": ("doc", "<i8"),
        }
    )

    def __post_init__(self) -> None:
        self._tok: Any = None
        self._renderer: Renderer | None = None

    def identity(self) -> dict[str, Any]:
        import hashlib

        return {
            "encoder": VERSION,
            "tokenizer": directory_identity(self.tokenizer),
            "template": "sha256:" + hashlib.sha256(self.template.encode()).hexdigest(),
            "train_on": self.train_on,
        }

    def vocab_size(self) -> int:
        return len(self._tokenizer())

    def _tokenizer(self) -> Any:
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer)
        return self._tok

    def start(self) -> None:
        tok = self._tokenizer()
        self._renderer = Renderer(self.template, dict(tok.special_tokens_map), self.origin)

    def render(self, record: dict[str, Any], where: str) -> tuple[str, list[tuple[int, int]]]:
        """One row's rendering and its supervised character spans."""
        assert self._renderer is not None, "start() first"
        conv = conversation(record, where)
        train_on = self.train_on or default_train_on(conv)
        return self._renderer.supervised(conv, train_on, where)

    def encode(self, values: list[Any], where: list[str], ends: list[bool] | None) -> Encoded:
        del ends
        rendered = [self.render(v, w) for v, w in zip(values, where)]
        # The Rust tokenizer on the whole chunk; as apply_chat_template tokenizes a rendering:
        # no special tokens added (the template writes its own).
        encodings = self._tok.backend_tokenizer.encode_batch(
            [text for text, _ in rendered], add_special_tokens=False
        )
        ids, masks, targets, first = [], [], [], []
        for enc, (_, spans) in zip(encodings, rendered):
            mask = token_mask(np.asarray(enc.offsets, np.int64).reshape(-1, 2), spans)
            mask[:1] = 0  # the first token is predicted from nothing
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
    """(token ids, mask) of one row, as the shards hold them (for checks and previews)."""
    if encoder._renderer is None:
        encoder.start()
    out = encoder.encode([record], [where], None)
    return out.tokens, out.extras["mask"]
