"""Loading real tokenizers. Two kinds, by what reads them:

- `load_tokenizer`: a `tokenizers.Tokenizer` from a `tokenizer.json` (or a Hugging Face
  tokenizer directory holding one), for text, pairs and exports: ids and nothing else.
- `load_hf_tokenizer`: a transformers fast tokenizer from a tokenizer directory or a
  tokenizer.json, for data=chat: its chat template, its special tokens, and the characters
  each token covers (offsets).

Corpora are tokenized with them by `trainer.data.shards`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config.errors import UserError

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

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


def load_tokenizer(path: str | Path, key: str = "data.tokenizer") -> Tokenizer:
    """A `tokenizers.Tokenizer` (ids only: no chat template, no offsets kept); one paragraph if
    the extra is missing or the file is bad."""
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


def load_hf_tokenizer(path: str | Path, key: str = "data.tokenizer") -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer from a tokenizer directory (`AutoTokenizer`, never running
    code from it) or a bare tokenizer.json; one paragraph when it cannot be read."""
    try:
        import transformers
    except ImportError:
        raise UserError(
            f"{key}: data=chat renders with transformers' chat templates, which is not "
            f"installed; install the extra: pip install 'cumulus[{EXTRA}]'"
        ) from None
    p = Path(path).expanduser()
    try:
        if p.is_dir():
            tok = transformers.AutoTokenizer.from_pretrained(str(p), trust_remote_code=False)
        elif p.is_file():
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(p))
        else:
            raise FileNotFoundError(f"{p} does not exist")
    except Exception as exc:  # transformers raises many kinds; the message is what matters
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{key}: {path} is not a tokenizer transformers can load ({first[:200]}): expected "
            "a tokenizer directory (save_pretrained: tokenizer.json, tokenizer_config.json) or "
            "a tokenizer.json file"
        ) from None
    if not isinstance(tok, transformers.PreTrainedTokenizerFast):
        raise UserError(
            f"{key}: {path} loads as a slow (Python) tokenizer; data=chat needs a fast one "
            "(a tokenizer.json) for the characters each token covers"
        )
    return tok


def eos_id(tokenizer: Any) -> int | None:
    """The end-of-text token placed between documents, if the tokenizer has one."""
    for name in EOS_NAMES:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    return None


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def pretrained_tokenizer(tokenizer: str | None, pretrained: str | None) -> str | None:
    """`data.tokenizer`, else the tokenizer of the `model.pretrained` directory (its
    tokenizer.json): a model is fed the ids it was trained on. A pretrained directory without
    one, fed UTF-8 bytes, must have a vocabulary of 256 (a byte-level model), else the text
    is refused in one paragraph."""
    if tokenizer or not pretrained:
        return tokenizer
    path = Path(pretrained).expanduser()
    if (path / "tokenizer.json").is_file():
        return str(path)
    import json

    try:
        vocab = json.loads((path / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        vocab = None  # the model's own loading says what is wrong with its directory
    if isinstance(vocab, int) and vocab != 256:
        raise UserError(
            f"data.tokenizer: model.pretrained={pretrained} holds no tokenizer.json and "
            "data.tokenizer is not set, so the text would be fed as UTF-8 bytes (ids 0-255) "
            f"to a model whose vocabulary has {vocab} tokens. Set data.tokenizer= the "
            "tokenizer the model was trained with (a tokenizer.json or a directory holding one)"
        )
    return None


def tokenizer_source(tokenizer: str | None, pretrained: str | None) -> str | None:
    """`data.tokenizer`, else the `model.pretrained` directory when it holds a tokenizer."""
    if tokenizer:
        return tokenizer
    if pretrained:
        p = Path(pretrained).expanduser()
        if (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file():
            return str(p)
    return None
