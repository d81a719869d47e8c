"""`data=chat`: fine-tuning on conversations.

Rows of `messages` or `prompt` + `completion` (trainer/data/chat_rows.py) from JSON Lines,
Parquet or a `save_to_disk` directory are rendered with the chat template of the tokenizer
(`data.tokenizer`, by default the `model.pretrained` directory's) or `data.chat_template`,
and tokenized once per job by the corpus machinery (trainer/data/shards.py) with the
supervision mask beside the tokens (trainer/data/chat_encode.py). The cache is keyed by the
files, the tokenizer, the template and `data.train_on`.

Opening the data decides which conversations train: `data.truncation=drop` drops those longer
than `data.max_length`, `cut` keeps their first `max_length` tokens; either way a
conversation left with no supervised target is dropped, and every drop is counted. With
`data.packed=true` whole conversations are packed into rows of `max_length` tokens
(trainer/data/packing.py); a batch then carries `position_ids` that restart at 0 with each
conversation, which is how the models keep each conversation attending only to itself.

A row is a `TextSequence` (trainer/data/sequence.py, which aligns the labels); its sample is
a dict of `input_ids`, `shift_labels` (the token each position predicts, -100 where it
predicts nothing: prompts, the last token of each conversation, padding) and, packed,
`position_ids`. The loss is the cross-entropy summed over the supervised targets, divided by
their number over the whole window (engine/steps/accumulate.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.tasks import IGNORE_INDEX
from trainer.config.errors import UserError
from trainer.data import DataSplits
from trainer.data.chat_encode import ChatEncoder
from trainer.data.chat_render import MARKERS, TRAIN_ON, chat_template
from trainer.data.chat_rows import COLUMNS
from trainer.data.collate import PadCollate
from trainer.data.hf import sources
from trainer.data.packing import one_per_row, pack
from trainer.data.sequence import TextSequence
from trainer.data.shards import Source, TokenStore, open_shards
from trainer.data.tokenize import load_hf_tokenizer, tokenizer_source
from trainer.tracking.plurals import counted

TRUNCATION = ("drop", "cut")
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass
class Selection:
    """The conversations of a store that train (`docs`, store indices) and the tokens each
    uses (`lengths`: whole, or cut at max_length), with what was dropped and why."""

    docs: np.ndarray
    lengths: np.ndarray
    too_long: int = 0
    unsupervised: int = 0

    @property
    def dropped(self) -> int:
        return self.too_long + self.unsupervised


def select(store: TokenStore, candidates: np.ndarray, max_length: int, cut: bool) -> Selection:
    """Of the store's documents `candidates` (indices), those that keep a supervised target
    within `max_length` tokens."""
    lengths = np.diff(store.doc_offsets)[candidates]
    targets = store.doc_extra("targets")[candidates]
    first = store.doc_extra("first_target")[candidates]
    if cut:
        keep = (targets > 0) & (first < max_length)
        return Selection(
            candidates[keep], np.minimum(lengths[keep], max_length), 0, int((~keep).sum())
        )
    fits = lengths <= max_length
    keep = fits & (targets > 0)
    unsupervised = int((fits & (targets == 0)).sum())
    return Selection(candidates[keep], lengths[keep], int((~fits).sum()), unsupervised)


class ChatSamples:
    """Rows of whole conversations (a map-style dataset): row r holds the conversations
    `conv[row_ptr[r]:row_ptr[r + 1]]` of `selection`, each reading its first `lengths` tokens
    from the memory-mapped store."""

    def __init__(
        self,
        store: TokenStore,
        selection: Selection,
        row_ptr: np.ndarray,
        conv: np.ndarray,
        packed: bool,
        max_length: int,
    ) -> None:
        self.store, self.selection = store, selection
        self.packed, self.max_length = packed, max_length
        self.row_ptr, self.conv = row_ptr, conv
        self.starts = store.doc_offsets[selection.docs]

    def __len__(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def dropped(self) -> int:
        return self.selection.dropped

    def conversations(self, row: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The (token ids, target mask) of each conversation of `row`, in row order."""
        out = []
        for c in self.conv[self.row_ptr[row] : self.row_ptr[row + 1]].tolist():
            a = int(self.starts[c])
            b = a + int(self.selection.lengths[c])
            out.append(
                (self.store.read(a, b).astype(np.int64), self.store.read_extra("mask", a, b))
            )
        return out

    def sequence(self, row: int) -> TextSequence:
        """Row `row` aligned for next-token prediction (what training and preview read)."""
        return TextSequence.from_documents(self.conversations(row))

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        return self.sequence(row).as_sample(self.packed)


def collate(packed: bool) -> PadCollate:
    """Pads each field to the longest row of the micro-batch: ids with 0, targets with -100,
    positions with 0 (each padding token its own sequence, after every real one)."""
    pad = {"input_ids": 0, "shift_labels": IGNORE_INDEX}
    if packed:
        pad["position_ids"] = 0
    return PadCollate(pad=pad)


def model_context(pretrained: str | None, fallback: int | None) -> int | None:
    """The context of the `model.pretrained` directory's config.json, else `fallback`."""
    if pretrained:
        try:
            raw = json.loads((Path(pretrained).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            raw = {}
        for name in CONTEXT_FIELDS:
            value = raw.get(name) if isinstance(raw, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return value
    return fallback


def _check(
    train_on: str | None, truncation: str, max_length: int | None, val_every_nth: int
) -> None:
    # Messages start with the argument's name: the trainer names the config key from it.
    if train_on is not None and train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)} or null, got {train_on!r}")
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be drop or cut, got {truncation!r}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
    if val_every_nth < 2:
        raise ValueError("val_every_nth must be at least 2")


def _source(path: str) -> Source:
    train, _ = sources(Path(path).expanduser(), "messages", "data=chat")
    return dataclasses.replace(train, columns=COLUMNS)


@dataclass
class ChatStores:
    """A chat data set opened: its tokenizer, its encoder and its token stores."""

    tok: Any
    encoder: ChatEncoder
    train: TokenStore
    val: TokenStore | None


def open_chat(
    path: str,
    val_path: str | None,
    tokenizer: str | None,
    chat_template_file: str | None,
    train_on: str | None,
    pretrained: str | None,
    cache_dir: str | None,
    tokenize_workers: int | None,
) -> ChatStores:
    """Tokenize (once per job) or reuse the data set's shards. The tokenizer is loaded once
    here; the encoder (and the workers it forks into) use it."""
    if not path or path == "required":
        raise ValueError("path: data=chat needs data.path= a .jsonl, .parquet or save_to_disk dir")
    tok_path = tokenizer_source(tokenizer, pretrained)
    if tok_path is None:
        where = f"; model.pretrained={pretrained} holds none" if pretrained else ""
        raise UserError(
            "data.tokenizer: data=chat renders conversations with a tokenizer's chat template: "
            "set data.tokenizer=DIR (a tokenizer directory), or model.pretrained=DIR holding "
            f"one{where}"
        )
    key = "data.tokenizer" if tokenizer else "model.pretrained"
    tok = load_hf_tokenizer(tok_path, key)
    template = chat_template(tok, chat_template_file, tok_path)
    origin = "data.chat_template" + ("" if chat_template_file else f" (the template of {tok_path})")
    encoder = ChatEncoder(str(tok_path), template, origin, train_on, tok)
    train_src = _source(path)
    val_src = _source(val_path) if val_path else None

    def load(src: Source) -> TokenStore:
        return open_shards(src, None, cache_dir, tokenize_workers, encoder=encoder)

    return ChatStores(tok, encoder, load(train_src), load(val_src) if val_src else None)


def chat_data(
    path: str,
    val_path: str | None = None,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    train_on: str | None = None,
    max_length: int | None = None,
    truncation: str = "drop",
    packed: bool = True,
    val_every_nth: int = 10,
    pretrained: str | None = None,
    context: int | None = None,
    seed: int = 0,
    cache: bool = True,
    tokenize_workers: int | None = None,
    cache_dir: str | None = None,
) -> DataSplits:
    """The `data._target_` of `data=chat` (configs/data/chat.yaml says what each key does).
    `pretrained`, `context`: the model's directory and context (interpolated from `model`);
    `seed`: the packing's."""
    _check(train_on, truncation, max_length, val_every_nth)
    if tokenize_workers is not None and tokenize_workers < 0:
        raise ValueError(f"tokenize_workers must be >= 0 or null, got {tokenize_workers}")
    length = max_length or model_context(pretrained, context)
    if length is None:
        raise ValueError("max_length: the model names no context; set data.max_length=TOKENS")
    if not cache:
        import tempfile

        cache_dir = tempfile.mkdtemp(prefix="cumulus-shards-")
    stores = open_chat(
        path, val_path, tokenizer, chat_template, train_on, pretrained, cache_dir, tokenize_workers
    )
    train, val = _splits(stores, length, truncation == "cut", packed, val_every_nth, seed)
    if not len(train):
        raise UserError(_nothing_to_train(path, train.selection, length, stores.encoder))
    if not len(val):
        raise UserError(
            f"data.path: {path} leaves no validation conversation (data.val_every_nth="
            f"{val_every_nth}); give more rows, or data.val_path="
        )
    tok = stores.tok
    return DataSplits(
        train=train,
        val=val,
        collate_fn=collate(packed),
        vocab_size=max(len(tok), stores.train.max_id + 1),
        seq_len=length,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        description=_description(path, stores, train, val, length),
    )


def _splits(
    stores: ChatStores, length: int, cut: bool, packed: bool, val_every_nth: int, seed: int
) -> tuple[ChatSamples, ChatSamples]:
    store = stores.train
    every = np.arange(len(store.doc_offsets) - 1)
    if stores.val is None:  # every n-th conversation validates
        held = every % val_every_nth == 0
        parts = [(store, every[~held]), (store, every[held])]
    else:
        parts = [(store, every), (stores.val, np.arange(len(stores.val.doc_offsets) - 1))]
    out = []
    for k, (s, candidates) in enumerate(parts):
        chosen = select(s, candidates, length, cut)
        rows = pack(chosen.lengths, length, seed + k) if packed else one_per_row(len(chosen.docs))
        out.append(ChatSamples(s, chosen, *rows, packed=packed, max_length=length))
    return out[0], out[1]


def _nothing_to_train(path: str, sel: Selection, length: int, encoder: ChatEncoder) -> str:
    on = encoder.train_on or "assistant/completion (by row)"
    return (
        f"data.path: no conversation of {path} has a supervised token to train on "
        f"(data.train_on={on}): {sel.too_long} are longer than data.max_length={length} "
        f"(data.truncation=cut keeps their first tokens) and {sel.unsupervised} have no "
        "supervised token (no assistant turn, or none left after truncation). "
        "`python -m trainer.preview` shows what each row supervises."
    )


def _description(
    path: str, stores: ChatStores, train: ChatSamples, val: ChatSamples, length: int
) -> str:
    sel = train.selection
    masks = "generation markers" if MARKERS.search(stores.encoder.template) else "prefix method"
    dropped = (
        f"; {sel.dropped} dropped ({sel.too_long} longer than data.max_length, "
        f"{sel.unsupervised} with no supervised token)"
        if sel.dropped
        else ""
    )
    rows = (
        f"packed into {counted(len(train), 'row')}" if train.packed else counted(len(train), "row")
    )
    cache = "token cache reused: " if stores.train.reused else "tokenized into "
    return (
        f"{len(sel.docs)} train / {len(val.selection.docs)} val conversations from {path}"
        f"{dropped}, {rows} of up to {length} tokens, masks from {masks} ({cache}"
        f"{stores.train.root})"
    )
