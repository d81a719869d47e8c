"""`data=hf`: language-modelling data from dataset files (local, no download): JSON Lines,
Parquet, or a directory written by `datasets`' `save_to_disk`. Each record's `text_field` is
one document; documents are tokenized once (bytes, or `tokenizer=` a tokenizer.json) and
cached next to the data, keyed by the documents' contents and the tokenizer. Samples are
packed blocks or one padded sample per document, through the same split-invariant sampler
as every dataset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.data import DataSplits
from trainer.data.text import collate, decode_bytes, token_samples
from trainer.data.tokenize import EXTRA, Tokenized, decoder, load_tokenizer, tokenize
from trainer.errors import UserError

SUFFIXES = (".jsonl", ".json", ".parquet")


def _missing(path: Path, field: str, where: str, fields: list[str]) -> UserError:
    return UserError(
        f"data.text_field: {where} of {path} has no field {field!r}; its fields: "
        f"{', '.join(map(repr, fields)) or 'none'}. Set data.text_field= to the field that "
        "holds the text."
    )


def _text(value: Any) -> str:
    return "" if value is None else str(value)  # a null text is an empty document


def _jsonl(path: Path, field: str) -> list[str]:
    """JSON Lines, or (a `.json` file starting with `[`) one JSON array of records."""
    with path.open(encoding="utf-8") as f:
        head = f.read(1024).lstrip()
    if path.suffix == ".json" and head.startswith("["):
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise UserError(f"data.path: {path} is not JSON ({exc})") from None
        where = [f"record {n}" for n in range(1, len(records) + 1)]
    else:
        records, where = [], []
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise UserError(f"data.path: line {n} of {path} is not JSON ({exc})") from None
                where.append(f"line {n}")
    texts = []
    for record, at in zip(records, where):
        if not isinstance(record, dict) or field not in record:
            raise _missing(path, field, at, list(record) if isinstance(record, dict) else [])
        texts.append(_text(record[field]))
    return texts


def _parquet(path: Path, field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"data.path: reading Parquet needs pyarrow; pip install 'cumulus[{EXTRA}]'"
        ) from None
    names = pq.read_schema(path).names
    if field not in names:
        raise _missing(path, field, "the schema", names)
    return [_text(t) for t in pq.read_table(path, columns=[field]).column(field).to_pylist()]


def _saved(path: Path, field: str) -> tuple[list[str], list[str] | None]:
    """Texts of a `save_to_disk` directory: a Dataset, or a DatasetDict whose `train` split
    trains and whose `validation` (or `test`) split, if any, validates."""
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"data.path: a save_to_disk directory needs the datasets library; pip install "
            f"'cumulus[{EXTRA}]'"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(
            f"data.path: {path} is not a datasets save_to_disk directory ({exc})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"data.path: {path} has splits {list(ds)}, none named train")
        val = next((ds[s] for s in ("validation", "test") if s in ds), None)
        train = ds["train"]
    else:
        train, val = ds, None
    for split in (train, val):
        if split is not None and field not in split.column_names:
            raise _missing(path, field, "the dataset", split.column_names)
    texts = [_text(t) for t in train[field]]
    return texts, None if val is None else [_text(t) for t in val[field]]


def read_texts(path: Path, field: str) -> tuple[list[str], list[str] | None]:
    """(training texts, validation texts if the data has its own split)."""
    if not path.exists():
        raise UserError(
            f"data.path: {path} does not exist. data=hf reads a JSON Lines file (.jsonl), a "
            "Parquet file (.parquet) or a datasets save_to_disk directory, from local disk."
        )
    if path.is_dir():
        return _saved(path, field)
    if path.suffix in (".jsonl", ".json"):
        return _jsonl(path, field), None
    if path.suffix == ".parquet":
        return _parquet(path, field), None
    raise UserError(
        f"data.path: {path} has suffix {path.suffix!r}; data=hf reads {', '.join(SUFFIXES)} "
        "files or a save_to_disk directory (for plain text use data=stdlib with data.path=)"
    )


def hf_data(
    path: str,
    text_field: str = "text",
    tokenizer: str | None = None,
    packed: bool = True,
    block_size: int = 128,
    val_path: str | None = None,
    val_every_nth: int = 10,
    min_sample_len: int = 8,
    cache: bool = True,
) -> DataSplits:
    """The `data._target_` of `data=hf`. Validation: `val_path`, else the data's own
    validation split, else every `val_every_nth`-th document."""
    if not path or path == "required":
        raise ValueError("path: data=hf needs data.path= a .jsonl, .parquet or save_to_disk dir")
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number, got {block_size}")
    if val_every_nth < 2:
        raise ValueError("val_every_nth must be at least 2")
    source = Path(path).expanduser()
    texts, val_texts = read_texts(source, text_field)
    if val_path is not None:
        val_texts, _ = read_texts(Path(val_path).expanduser(), text_field)
    if val_texts is None:
        val_texts = texts[::val_every_nth]
        texts = [t for i, t in enumerate(texts) if i % val_every_nth]
    if not texts or not val_texts:
        raise UserError(f"data.path: {source} holds too few documents for a train/val split")
    cache_dir = None
    if cache:  # next to the data; a read-only location just means no cache
        cache_dir = (source if source.is_dir() else source.parent) / ".cumulus-cache"
    docs: list[Tokenized] = [tokenize(t, tokenizer, cache_dir) for t in (texts, val_texts)]
    train, val = (
        token_samples(d.tokens, d.offsets, packed, block_size, min_sample_len) for d in docs
    )
    vocab, decode = 256, decode_bytes
    if tokenizer:
        tok = load_tokenizer(tokenizer)
        vocab, decode = tok.get_vocab_size(), decoder(tok)
    biggest = max((int(d.tokens.max()) + 1 for d in docs if len(d.tokens)), default=vocab)
    return DataSplits(
        train=train,
        val=val,
        collate_fn=collate,
        vocab_size=max(vocab, biggest),
        seq_len=block_size,
        decode=decode,
        description=f"{len(texts)} train / {len(val_texts)} val documents from {source}",
    )
