"""Real tokenizers (a `tokenizer.json` of the `tokenizers` library, or a Hugging Face
tokenizer directory holding one), and documents tokenized once and cached.

The cache key is the SHA-256 of the documents' bytes and of the tokenizer file, so editing
either re-tokenizes and nothing stale is ever read. Each cache file is written under a
temporary name and renamed, so ranks that tokenize at the same time never see half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.errors import UserError

EXTRA = "hf"
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>")


def tokenizer_file(path: str | Path, key: str = "data.tokenizer") -> Path:
    """The `tokenizer.json` that `path` names (the file, or a directory holding it)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise UserError(
            f"{key}: {path} is not a tokenizer: expected a tokenizer.json file or a Hugging Face "
            "tokenizer directory holding one (scripts/train_tokenizer.py writes one from local "
            "text; nothing is downloaded)"
        )
    return p


def load_tokenizer(path: str | Path, key: str = "data.tokenizer") -> Any:
    """A `tokenizers.Tokenizer`; one paragraph if the extra is missing or the file is bad."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(
            f"{key}: the tokenizers library is not installed; install the extra: "
            f"pip install 'cumulus[{EXTRA}]'"
        ) from None
    file = tokenizer_file(path, key)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust library raises its own exception type
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{key}: {file} does not parse as a tokenizers tokenizer.json ({first[:200]}); "
            "write one with scripts/train_tokenizer.py or tokenizer.save(PATH)"
        ) from None


def eos_id(tokenizer: Any) -> int | None:
    """The end-of-text token placed between documents, if the tokenizer has one."""
    for name in EOS_NAMES:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    return None


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


class Tokenized:
    """Documents as one token array and their boundaries: document i is
    `tokens[offsets[i] : offsets[i + 1]]` (its end-of-text token included, if any)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray) -> None:
        self.tokens, self.offsets = tokens, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1


def _digest(texts: Sequence[str], tokenizer_path: Path | None) -> str:
    h = hashlib.sha256()
    h.update(b"cumulus-tokens/1\0")
    h.update(tokenizer_path.read_bytes() if tokenizer_path is not None else b"bytes")
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:24]


def tokenize(
    texts: Sequence[str],
    tokenizer_path: str | Path | None,
    cache_dir: Path | None,
    key: str = "data.tokenizer",
) -> Tokenized:
    """`texts` tokenized (UTF-8 bytes without a tokenizer), from the cache when it holds them."""
    file = tokenizer_file(tokenizer_path, key) if tokenizer_path else None
    cached = None
    if cache_dir is not None:
        cached = cache_dir / f"tokens-{_digest(texts, file)}.npz"
        try:
            with np.load(cached) as z:
                return Tokenized(z["tokens"], z["offsets"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError):  # damaged: tokenize again and rewrite it
            with contextlib.suppress(OSError):
                cached.unlink()
    if file is None:
        parts = [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8) for t in texts]
    else:
        tok = load_tokenizer(file, key)
        eos = eos_id(tok)
        tail = [eos] if eos is not None else []
        parts = [np.asarray(e.ids + tail, dtype=np.int64) for e in tok.encode_batch(list(texts))]
    lengths = np.array([0] + [len(p) for p in parts], dtype=np.int64)
    biggest = max((int(p.max()) for p in parts if len(p)), default=0)
    dtype = np.uint16 if biggest < 2**16 else np.int32
    tokens = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    out = Tokenized(tokens, np.cumsum(lengths))
    if cached is not None and not cached.exists():  # another rank may have written it
        tmp = cached.with_name(f".{cached.name}.{uuid.uuid4().hex[:8]}.npz")
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            np.savez(tmp, tokens=out.tokens, offsets=out.offsets)
            os.link(tmp, cached)  # never replaces a file another rank may be reading
        except OSError:
            pass  # exists already, or a read-only data directory: nothing to do
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    return out
