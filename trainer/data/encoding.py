"""How records become tokens in the corpus machinery (trainer/data/shards.py): the `Encoder`
protocol its tokenizer workers call, and the encoder of text documents.

An encoder runs in each worker process (inherited by fork): `start()` once, then `encode()`
per chunk of records. Besides tokens and document lengths it may return extra arrays, per
token or per document (data=chat's supervision mask), which the shards store beside the
tokens. `identity()` joins the cache key. A record the encoder cannot read raises
`BadRecord`, naming the file and line: its shard set is deleted, never left half-written.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trainer.config.errors import UserError

# Files of a tokenizer directory that decide its ids and the text its template renders.
TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|chat_template.*|vocab.*|"
    r"merges.*|.*\.model|.*\.tiktoken)$"
)


class BadRecord(UserError):
    """A record of the data is not what the reader or encoder expects (named by file and line,
    `FILE:LINE`, or row). The shards of that data are deleted: they could never be completed.

    `message` says what is wrong with the record; `hint` what would be valid (said once when
    several records are reported together). `of_row`: false for a refusal that is not about
    one record (a chat template that cannot be read by prefixes): reported at once, alone."""

    of_row = True

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(f"{message} {hint}" if hint else message)
        self.message, self.hint = message, hint

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a tokenizer worker process
        return type(self), (self.message, self.hint)


@dataclass
class Encoded:
    """One chunk's documents as tokens: `tokens` (int64), `lengths` (per document), and the
    encoder's extra arrays (`Encoder.extras`), per token or per document."""

    tokens: np.ndarray
    lengths: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)


class Encoder(Protocol):
    """What turns a chunk's records into tokens, in a tokenizer worker process (inherited by
    fork). `identity()` joins the cache key; `extras` names the arrays written beside the
    tokens: name -> ("token" or "doc", NumPy dtype string)."""

    extras: dict[str, tuple[str, str]]

    def identity(self) -> Any: ...
    def vocab_size(self) -> int: ...
    def start(self) -> None: ...
    def encode(self, values: list[Any], where: list[str], ends: list[bool] | None) -> Encoded: ...


class TextEncoder:
    """Text documents: UTF-8 bytes (no tokenizer), or a `tokenizers` tokenizer.json with its
    end-of-text token after each document (if it has one)."""

    extras: dict[str, tuple[str, str]] = {}  # noqa: RUF012 (read-only)

    def __init__(self, tokenizer: Path | None) -> None:
        self.tokenizer = tokenizer
        self.tok: Any = None
        self.eos: int | None = None

    def identity(self) -> str:
        return tokenizer_identity(self.tokenizer)

    def vocab_size(self) -> int:
        if self.tokenizer is None:
            return 256
        from trainer.data.tokenize import load_tokenizer

        return load_tokenizer(self.tokenizer).get_vocab_size()

    def start(self) -> None:
        if self.tokenizer is not None:
            from trainer.data.tokenize import eos_id, load_tokenizer

            self.tok = load_tokenizer(self.tokenizer)
            self.eos = eos_id(self.tok)

    def encode(self, values: list[Any], where: list[str], ends: list[bool] | None) -> Encoded:
        """Documents end with the tokenizer's end-of-text token, if it has one (bytes: no
        separator); a text piece that does not end its file gets none."""
        del where
        ends = ends or [True] * len(values)
        if self.tok is None:
            parts = [np.frombuffer(t.encode("utf-8", errors="replace"), np.uint8) for t in values]
        else:
            tail = [self.eos] if self.eos is not None else []
            # Ids only: encode_batch_fast skips the character offsets encode_batch tracks
            # (the same ids, about a fifth fewer instructions; docs/benchmarks.md).
            parts = [
                np.asarray(e.ids + (tail if end else []), dtype=np.int64)
                for e, end in zip(self.tok.encode_batch_fast(values), ends)
            ]
        lengths = np.array([len(p) for p in parts], dtype=np.int64)
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        return Encoded(tokens, lengths)


def tokenizer_identity(tokenizer: Path | None) -> str:
    """A `tokenizer.json`'s digest (None: UTF-8 bytes)."""
    if tokenizer is None:
        return "bytes"
    return "sha256:" + hashlib.sha256(tokenizer.read_bytes()).hexdigest()


def tokenizer_files_identity(path: str | Path) -> str:
    """A digest of the files that decide a tokenizer's ids and its rendering (not weights):
    a tokenizer.json, or those of a tokenizer directory (`TOKENIZER_FILES`)."""
    p = Path(path).expanduser()
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if TOKENIZER_FILES.match(f.name))
    digest = hashlib.sha256()
    for f in files:
        if f.is_file():
            digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return "sha256:" + digest.hexdigest()


def text_identity(text: str) -> str:
    """A text's digest (a chat template's)."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
