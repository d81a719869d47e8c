"""`data=pairs`: (anchor, positive) text pairs for `task=contrastive`, from local JSON Lines,
Parquet or `save_to_disk` data.

Each row holds an anchor text and its positive (`anchor_field`, `positive_field`). Both are
tokenized with the model directory's tokenizer (`tokenizer`: by default `model.pretrained`; a
`tokenizer.json` or a directory holding one), special tokens added (BERT's [CLS] ... [SEP])
and cut to `max_length` tokens: by default the model's own limit (`model.pretrained`'s
config.json, else `model.config.max_position_embeddings`), at most `MAX_LENGTH`. They are
tokenized once per job by the corpus machinery (trainer/data/shards.py): memory-mapped shards
keyed by the files, the tokenizer, the fields and `max_length`, reused by later runs. A sample
is the pair of token id arrays; a micro-batch pads both to the longest of the micro-batch into
`input_ids` and `attention_mask` of shape (samples, 2, length). Validation: `val_path`, else
every `val_every_nth`-th row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config.errors import UserError
from trainer.data import DataSplits
from trainer.data.chat import model_context
from trainer.data.encoding import BadRecord, Encoded, tokenizer_identity
from trainer.data.hf import sources
from trainer.data.shards import Source, TokenStore, open_shards
from trainer.data.tokenize import load_tokenizer, tokenizer_file

PAD_NAMES = ("[PAD]", "<pad>", "<|pad|>")
# The longest default max_length: BERT's 512 positions. Longer models (8k-position encoders)
# rarely need it for pairs, and padding to the longest of a micro-batch costs memory.
MAX_LENGTH = 512
VERSION = "pairs/1"
FIELD_KEYS = ("data.anchor_field", "data.positive_field")


def _texts(row: Any, fields: tuple[str, str], where: str) -> tuple[str, str]:
    if not isinstance(row, dict):
        raise BadRecord(f"data.path: {where} is a {type(row).__name__}, not a JSON object")
    out = []
    for name, field in zip(FIELD_KEYS, fields):
        if row.get(field) is None:
            raise BadRecord(
                f"data.path: {where} has no field {field!r} ({name}; the row has "
                f"{', '.join(map(repr, sorted(row)[:10])) or 'no field'}).",
                f"Set {name}= the field holding the text.",
            )
        value = row[field]
        if not isinstance(value, str):
            raise BadRecord(
                f"data.path: {where}: field {field!r} ({name}) is not a text: "
                f"{repr(value)[:60]} ({type(value).__name__})."
            )
        out.append(value)
    return out[0], out[1]


@dataclass
class PairEncoder:
    """The encoder of `data=pairs` for the corpus machinery: a row's anchor and positive,
    tokenized (special tokens added, cut to `max_length`), stored as one document, the anchor's
    ids then the positive's; per pair the anchor's length and how many of its texts were cut."""

    tokenizer: Path  # the tokenizer.json
    fields: tuple[str, str]
    max_length: int
    extras: dict[str, tuple[str, str]] = dataclasses.field(
        default_factory=lambda: {"anchor_len": ("doc", "<i8"), "cut": ("doc", "<i8")}
    )

    def __post_init__(self) -> None:
        self.tok: Any = None

    def identity(self) -> dict[str, Any]:
        return {
            "encoder": VERSION,
            "tokenizer": tokenizer_identity(self.tokenizer),
            "fields": list(self.fields),
            "max_length": self.max_length,
        }

    def vocab_size(self) -> int:
        return load_tokenizer(self.tokenizer).get_vocab_size()

    def start(self) -> None:
        self.tok = load_tokenizer(self.tokenizer)
        self.tok.no_padding()
        self.tok.enable_truncation(self.max_length)

    def encode(self, values: list[Any], where: list[str], ends: list[bool] | None) -> Encoded:
        del ends
        pairs = [_texts(v, self.fields, w) for v, w in zip(values, where)]
        sides, cut = [], np.zeros(len(pairs), np.int64)
        for j in (0, 1):
            encodings = self.tok.encode_batch([p[j] for p in pairs], add_special_tokens=True)
            sides.append([e.ids for e in encodings])
            cut += [bool(e.overflowing) for e in encodings]
        ids = [np.asarray(a + p, np.int64) for a, p in zip(*sides)]
        return Encoded(
            tokens=np.concatenate(ids) if ids else np.zeros(0, np.int64),
            lengths=np.array([len(i) for i in ids], np.int64),
            extras={"anchor_len": np.array([len(a) for a in sides[0]], np.int64), "cut": cut},
        )


class PairSamples:
    """The pairs `docs` (document indices) of a store: sample i is `{"anchor": ids,
    "positive": ids}` (int32 arrays, read from the memory-mapped shards)."""

    def __init__(self, store: TokenStore, docs: np.ndarray) -> None:
        self.store, self.docs = store, docs
        self.starts = store.doc_offsets[docs]
        self.ends = store.doc_offsets[docs + 1]
        self.anchor_len = store.doc_extra("anchor_len")[docs]
        self.cut = int(store.doc_extra("cut")[docs].sum())

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        ids = self.store.read(int(self.starts[i]), int(self.ends[i])).astype(np.int32)
        n = int(self.anchor_len[i])
        return {"anchor": ids[:n], "positive": ids[n:]}


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


def pair_length(
    max_length: int | None, pretrained: str | None, context: int | None
) -> tuple[int, str]:
    """The tokens per text, and where that number comes from (for the start-up line)."""
    if max_length is not None:
        return max_length, "data.max_length"
    limit = model_context(pretrained, None)
    origin = f"the positions of model.pretrained={pretrained}"
    if limit is None:
        limit, origin = context, "model.config.max_position_embeddings"
    if limit is None:
        return MAX_LENGTH, f"the default, {MAX_LENGTH}: the model names no limit"
    if limit > MAX_LENGTH:
        return MAX_LENGTH, f"{origin}, {limit}, capped at {MAX_LENGTH}; data.max_length= for more"
    return limit, origin


def _source(path: str, fields: tuple[str, str], key: str) -> Source:
    src, _ = sources(Path(path).expanduser(), fields[0], "data=pairs")
    if src.kind == "parquet":  # a missing column: one sentence, not one per row
        import pyarrow.parquet as pq

        names = pq.read_schema(src.paths[0]).names
        missing = [f for f in fields if f not in names]
        if missing:
            raise UserError(
                f"{key}: {src.paths[0]} has no column {', '.join(map(repr, missing))} "
                f"(data.anchor_field / data.positive_field); its columns are {names[:10]}"
            )
    return dataclasses.replace(src, columns=fields)


def pairs_data(
    path: str,
    val_path: str | None = None,
    anchor_field: str = "anchor",
    positive_field: str = "positive",
    tokenizer: str | None = None,
    max_length: int | None = None,
    val_every_nth: int = 10,
    pretrained: str | None = None,
    context: int | None = None,
    cache: bool = True,
    tokenize_workers: int | None = None,
    cache_dir: str | None = None,
) -> DataSplits:
    """The `data._target_` of `data=pairs` (configs/data/pairs.yaml says what each key does).
    `tokenizer`: a tokenizer.json or a directory holding one (the config's default: the
    `model.pretrained` directory). `max_length`: null for the model's own limit (`pretrained`'s
    config.json, else `context`), at most `MAX_LENGTH`."""
    if not path or path == "required":
        raise ValueError("path: data=pairs needs data.path= a .jsonl or .parquet file of pairs")
    if max_length is not None and (type(max_length) is not int or max_length < 2):
        raise ValueError(f"max_length must be a number >= 2 or null, got {max_length!r}")
    if val_every_nth < 2:
        raise ValueError("val_every_nth must be at least 2")
    if tokenize_workers is not None and tokenize_workers < 0:
        raise ValueError(f"tokenize_workers must be >= 0 or null, got {tokenize_workers}")
    if not tokenizer:
        raise ValueError(
            "tokenizer: data=pairs tokenizes with the model directory's tokenizer; set "
            "model.pretrained=DIR (a save_pretrained directory with its tokenizer.json) or "
            "data.tokenizer= a tokenizer.json or a directory holding one"
        )
    length, origin = pair_length(max_length, pretrained, context)
    fields = (anchor_field, positive_field)
    tok = load_tokenizer(tokenizer, key="data.tokenizer")
    encoder = PairEncoder(tokenizer_file(tokenizer), fields, length)
    if not cache:
        import tempfile

        cache_dir = tempfile.mkdtemp(prefix="cumulus-shards-")
    train_src = _source(path, fields, "data.path")
    val_src = _source(val_path, fields, "data.val_path") if val_path is not None else None

    def load(src: Source) -> TokenStore:
        return open_shards(src, None, cache_dir, tokenize_workers, encoder=encoder)

    store = load(train_src)
    every = np.arange(len(store.doc_offsets) - 1)
    if val_src is None:  # every n-th row validates
        held = every % val_every_nth == 0
        train, val = PairSamples(store, every[~held]), PairSamples(store, every[held])
    else:
        val_store = load(val_src)
        train = PairSamples(store, every)
        val = PairSamples(val_store, np.arange(len(val_store.doc_offsets) - 1))
    if not len(train) or not len(val):
        raise UserError(
            f"data.path: {path} holds too few rows for a train/val split "
            f"({len(train)} train, {len(val)} val); add rows or set data.val_path"
        )
    cut = f"; {train.cut} texts cut to it" if train.cut else ""
    cached = "token cache reused: " if store.reused else "tokenized into "
    return DataSplits(
        train=train,
        val=val,
        collate_fn=PairCollate(pad_id(tok)),
        vocab_size=tok.get_vocab_size(),
        seq_len=length,
        description=f"{len(train)} train / {len(val)} val pairs from {path} (tokenizer "
        f"{tokenizer}, max_length {length} from {origin}{cut}; {cached}{store.root})",
    )
