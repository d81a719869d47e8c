"""`data=pairs`: (anchor, positive) text pairs for `task=contrastive`, from local JSON Lines or
Parquet files.

Each row holds an anchor text and its positive (`anchor_field`, `positive_field`). Both are
tokenized once, when the data is built, with the model directory's tokenizer (`tokenizer`:
by default `model.pretrained`; a `tokenizer.json` or a directory holding one), special tokens
added (BERT's [CLS] ... [SEP]) and cut to `max_length` tokens. A sample is the pair of token
id arrays; a micro-batch pads both to the longest of the micro-batch into `input_ids` and
`attention_mask` of shape (samples, 2, length). Validation: `val_path`, else every
`val_every_nth`-th row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config.errors import UserError
from trainer.data import DataSplits
from trainer.data.tokenize import EXTRA, load_tokenizer

SUFFIXES = (".jsonl", ".parquet")
PAD_NAMES = ("[PAD]", "<pad>", "<|pad|>")


def read_rows(path: Path, fields: tuple[str, str], key: str) -> Iterator[tuple[str, str]]:
    """(anchor, positive) of every row of a .jsonl or .parquet file; a bad row is one
    paragraph naming the file and line (or row) and what is wrong."""
    if not path.is_file():
        raise UserError(
            f"{key}: {path} does not exist; data=pairs reads a JSON Lines (.jsonl) or Parquet "
            "(.parquet) file of rows with an anchor and a positive text, from local disk"
        )
    if path.suffix == ".jsonl":
        yield from _jsonl_rows(path, fields)
    elif path.suffix == ".parquet":
        yield from _parquet_rows(path, fields, key)
    else:
        raise UserError(
            f"{key}: {path} has suffix {path.suffix!r}; data=pairs reads "
            f"{' or '.join(SUFFIXES)} files"
        )


def _texts(row: Any, fields: tuple[str, str], where: str) -> tuple[str, str]:
    if not isinstance(row, dict):
        raise UserError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    out = []
    for name, field in zip(("data.anchor_field", "data.positive_field"), fields):
        if field not in row:
            raise UserError(
                f"{where}: no field {field!r} ({name}); the row has {sorted(row)[:10]}. Set "
                f"{name}= the field holding the text"
            )
        value = row[field]
        if not isinstance(value, str):
            raise UserError(
                f"{where}: field {field!r} ({name}) must be a text, got {type(value).__name__}"
            )
        out.append(value)
    return out[0], out[1]


def _jsonl_rows(path: Path, fields: tuple[str, str]) -> Iterator[tuple[str, str]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise UserError(f"{where}: not valid JSON ({exc})") from None
            yield _texts(row, fields, where)


def _parquet_rows(path: Path, fields: tuple[str, str], key: str) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"{key}: reading Parquet needs pyarrow; pip install 'cumulus[{EXTRA}]'"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's own exception types
        raise UserError(f"{key}: {path} does not read as Parquet ({exc})") from None
    missing = [f for f in fields if f not in table.column_names]
    if missing:
        raise UserError(
            f"{path}: no column {', '.join(map(repr, missing))} (data.anchor_field / "
            f"data.positive_field); its columns are {table.column_names[:10]}"
        )
    columns = [table.column(f).to_pylist() for f in fields]
    for number, (a, p) in enumerate(zip(*columns)):
        yield _texts({fields[0]: a, fields[1]: p}, fields, f"{path} row {number}")


class PairSamples:
    """Tokenized pairs in two flat id arrays with offsets: sample i is
    `{"anchor": ids, "positive": ids}` (int32 arrays)."""

    def __init__(self, anchors: list[list[int]], positives: list[list[int]]) -> None:
        self.sides = [_flat(anchors), _flat(positives)]

    def __len__(self) -> int:
        return len(self.sides[0][1]) - 1

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        (a, a_off), (p, p_off) = self.sides
        return {"anchor": a[a_off[i] : a_off[i + 1]], "positive": p[p_off[i] : p_off[i + 1]]}


def _flat(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    flat = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


@dataclass(frozen=True)
class PairCollate:
    """Samples -> `input_ids` and `attention_mask` (samples, 2, length), padded with
    `pad_id` to the longest anchor or positive of the micro-batch."""

    pad_id: int

    def __call__(self, samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        length = max((len(s[k]) for s in samples for k in ("anchor", "positive")), default=1)
        ids = torch.full((len(samples), 2, length), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(samples), 2, length), dtype=torch.int64)
        for i, s in enumerate(samples):
            for j, side in enumerate(("anchor", "positive")):
                n = len(s[side])
                ids[i, j, :n] = torch.from_numpy(s[side].astype(np.int64))
                mask[i, j, :n] = 1
        return {"input_ids": ids, "attention_mask": mask}


def pad_id(tokenizer: Any) -> int:
    padding = tokenizer.padding
    if padding and "pad_id" in padding:
        return int(padding["pad_id"])
    for name in PAD_NAMES:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    return 0  # any id: the attention mask hides padding


def tokenize(tokenizer: Any, pairs: list[tuple[str, str]]) -> tuple[PairSamples, int]:
    """The pairs as token ids (special tokens added, cut to the tokenizer's truncation), and
    how many texts were cut."""
    sides, cut = [], 0
    for j in (0, 1):
        encodings = tokenizer.encode_batch([p[j] for p in pairs], add_special_tokens=True)
        sides.append([e.ids for e in encodings])
        cut += sum(bool(e.overflowing) for e in encodings)
    return PairSamples(sides[0], sides[1]), cut


def pairs_data(
    path: str,
    val_path: str | None = None,
    anchor_field: str = "anchor",
    positive_field: str = "positive",
    tokenizer: str | None = None,
    max_length: int = 128,
    val_every_nth: int = 10,
) -> DataSplits:
    """The `data._target_` of `data=pairs`. `tokenizer`: a tokenizer.json or a directory
    holding one (the config's default: the `model.pretrained` directory)."""
    if not path or path == "required":
        raise ValueError("path: data=pairs needs data.path= a .jsonl or .parquet file of pairs")
    if type(max_length) is not int or max_length < 2:
        raise ValueError(f"max_length must be a number >= 2, got {max_length!r}")
    if val_every_nth < 2:
        raise ValueError("val_every_nth must be at least 2")
    if not tokenizer:
        raise ValueError(
            "tokenizer: data=pairs tokenizes with the model directory's tokenizer; set "
            "model.pretrained=DIR (a save_pretrained directory with its tokenizer.json) or "
            "data.tokenizer= a tokenizer.json or a directory holding one"
        )
    fields = (anchor_field, positive_field)
    tok = load_tokenizer(tokenizer, key="data.tokenizer")
    tok.no_padding()
    tok.enable_truncation(max_length)
    rows = list(read_rows(Path(path).expanduser(), fields, "data.path"))
    if val_path is not None:
        val_rows = list(read_rows(Path(val_path).expanduser(), fields, "data.val_path"))
    else:
        val_rows = rows[::val_every_nth]
        rows = [r for i, r in enumerate(rows) if i % val_every_nth]
    if not rows or not val_rows:
        raise UserError(
            f"data.path: {path} holds too few rows for a train/val split "
            f"({len(rows)} train, {len(val_rows)} val); add rows or set data.val_path"
        )
    (train, cut), (val, _) = tokenize(tok, rows), tokenize(tok, val_rows)
    return DataSplits(
        train=train,
        val=val,
        collate_fn=PairCollate(pad_id(tok)),
        vocab_size=tok.get_vocab_size(),
        seq_len=max_length,
        description=f"{len(train)} train / {len(val)} val pairs from {path} (tokenizer "
        f"{tokenizer}, max_length {max_length}" + (f"; {cut} texts cut to it)" if cut else ")"),
    )
