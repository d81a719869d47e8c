"""`data=preference`: pairs of a prompt, a chosen and a rejected answer (`task=dpo`).

Rows in TRL's two preference layouts, from JSON Lines, Parquet or a `save_to_disk` directory:

- `prompt` (a string or messages) with `chosen` and `rejected` (a string: one assistant
  message; or the assistant's messages);
- `chosen` and `rejected` as whole conversations sharing their prompt: each side's prompt is
  its messages up to its last non-assistant one, and the two must be equal.

Rows are checked by data=chat's checks (trainer/data/chat_rows.py): a row that holds no pair
(no `chosen` or `rejected`, a prompt, answer or content that is not text, prompts that
differ, messages the template rejects) is refused as data=chat refuses its rows, with every
other bad row of the file in one paragraph naming each `FILE:LINE` (`bad_rows=refuse`), or
stored empty with its `status` and counted (`bad_rows=drop`). Each side is rendered with the
chat template exactly as `data=chat` renders a prompt and its completion
(trainer/data/chat_render.py): the scored tokens are the answer after the prompt's
generation prompt, through its end-of-turn token. The encoder stores one document per row,
the chosen tokens then the rejected ones, with the supervision mask beside them; a row with
no answer after its prompt is stored empty and counted, and opening the data counts the
pairs a side of which is longer than `data.max_length` (`truncation=drop`; `cut` keeps each
side's first tokens), of the whole file.

A sample is one pair: `input_ids` and `shift_labels` of shape (2, L), the chosen row then the
rejected one, each side its own sequence from position 0, -100 where no answer token is
predicted; a micro-batch stacks whole pairs, (pairs, 2, T), so a pair's two sides always sit
in the same micro-batch on the same rank, and the loader's batch arithmetic counts pairs.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.preference import PRECOMPUTED
from engine.tasks import IGNORE_INDEX
from trainer.config.errors import UserError
from trainer.data import DataSplits
from trainer.data.chat import model_context
from trainer.data.chat_encode import target_mask
from trainer.data.chat_render import Renderer, chat_template
from trainer.data.chat_rows import Conversation, message_list
from trainer.data.collate import PadCollate
from trainer.data.encoding import BadRecord, Encoded, text_identity, tokenizer_files_identity
from trainer.data.hf import sources
from trainer.data.sequence import TextSequence
from trainer.data.shards import Source, TokenStore, open_shards
from trainer.data.tokenize import load_hf_tokenizer, tokenizer_source

VERSION = "preference/2"
COLUMNS = ("prompt", "chosen", "rejected")
TRUNCATION = ("drop", "cut")
BAD_ROWS = ("refuse", "drop")
# What a stored row holds (its `status`): a pair, or why it holds none (data.bad_rows=drop; a
# row with no answer after its prompt is dropped either way, as data=chat drops a
# conversation with no supervised token).
OK, MISSING, NOT_TEXT, NO_ANSWER, DIFFERS = 0, 1, 2, 3, 4
EXPECTED = (
    'data=preference reads rows of "prompt" (a string or messages) with "chosen" and '
    '"rejected" (strings or assistant messages), or of "chosen" and "rejected" as whole '
    "conversations sharing their prompt"
)
# Said once after the bad rows of a file.
HINT = f"{EXPECTED}; data.bad_rows=drop trains on the other rows (the dropped ones counted)."


class SideMissing(BadRecord):
    """A row without its chosen or its rejected answer."""


class PromptsDiffer(BadRecord):
    """The chosen and rejected conversations of a row do not share their prompt."""


class NoAnswer(ValueError):
    """A row whose sides hold no answer after the prompt: dropped and counted, not refused."""


def _prompt_len(messages: list[dict[str, Any]]) -> int:
    """Messages up to and including the last non-assistant one."""
    k = len(messages)
    while k and messages[k - 1]["role"] == "assistant":
        k -= 1
    return k


def pair(record: dict[str, Any], where: str) -> tuple[Conversation, Conversation]:
    """The chosen and rejected conversations of a row (`where`: FILE:LINE), each with its
    prompt's length; a row that is no pair raises `BadRecord` naming `where` (the checks of
    data=chat's rows), one with no answer after its prompt `NoAnswer`."""
    record = {k: v for k, v in record.items() if v is not None}
    absent = [side for side in ("chosen", "rejected") if side not in record]
    if absent:
        raise SideMissing(
            f"data.path: {where} has no {' and no '.join(map(repr, absent))} (its fields: "
            f"{', '.join(map(repr, record)) or 'none'}).",
            HINT,
        )
    if "prompt" in record:
        prompt = message_list(record["prompt"], where, "prompt", "user", HINT)
        answers = [message_list(record[s], where, s, "assistant", HINT) for s in COLUMNS[1:]]
        sides = [Conversation(prompt + answer, len(prompt)) for answer in answers]
        return sides[0], sides[1]
    chosen, rejected = (message_list(record[s], where, s, None, HINT) for s in COLUMNS[1:])
    kc, kr = _prompt_len(chosen), _prompt_len(rejected)
    if chosen[:kc] != rejected[:kr]:
        at = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(kc, kr))
        raise PromptsDiffer(
            f"data.path: {where}: the chosen and rejected conversations do not share their "
            f"prompt (the messages before each one's final assistant answer): they differ at "
            f"message {at + 1} ({repr(chosen[at] if at < kc else None)[:60]} vs "
            f"{repr(rejected[at] if at < kr else None)[:60]}); or put the shared prompt in "
            '"prompt" and only the answers in "chosen" and "rejected".',
            HINT,
        )
    if kc == 0 or kc == len(chosen) or kr == len(rejected):
        raise NoAnswer(where)
    return Conversation(chosen, kc), Conversation(rejected, kr)


@dataclass
class PreferenceEncoder:
    """The corpus machinery's encoder of preference rows (trainer/data/encoding.py's
    `Encoder`): per row one document, the chosen side's tokens then the rejected side's.
    `bad_rows`: refuse (a row that is no pair raises its `BadRecord`, which the machinery
    reports with every other bad row of the file) or drop (stored empty, its `status` says
    why)."""

    tokenizer: str
    template: str
    origin: str
    bad_rows: str = "refuse"
    extras: dict[str, tuple[str, str]] = field(
        default_factory=lambda: {
            "mask": ("token", "|u1"),
            "chosen_len": ("doc", "<i8"),
            "first_chosen": ("doc", "<i8"),
            "first_rejected": ("doc", "<i8"),
            "status": ("doc", "<i8"),
        }
    )

    def __post_init__(self) -> None:
        self._tok: Any = None
        self._renderer: Renderer | None = None

    def identity(self) -> dict[str, Any]:
        return {
            "encoder": VERSION,
            "tokenizer": tokenizer_files_identity(self.tokenizer),
            "template": text_identity(self.template),
            "bad_rows": self.bad_rows,  # a refusing run never reads a store that dropped rows
        }

    def vocab_size(self) -> int:
        if self._tok is None:
            self._tok = load_hf_tokenizer(self.tokenizer)
        return len(self._tok)

    def start(self) -> None:
        if self._tok is None:
            self._tok = load_hf_tokenizer(self.tokenizer)
        self._renderer = Renderer(self.template, dict(self._tok.special_tokens_map), self.origin)

    def _render(self, record: Any, where: str) -> tuple[list[tuple[str, list]], int]:
        """Both sides' (rendering, scored character spans), and the row's status."""
        assert self._renderer is not None, "start() first"
        try:
            sides = pair(record, where)
            return [self._renderer.supervised(s, "completion", where) for s in sides], OK
        except NoAnswer:
            return [], NO_ANSWER
        except BadRecord as exc:  # not a pair, or messages the template rejects
            if self.bad_rows == "refuse" or not exc.of_row:
                raise
            return [], {SideMissing: MISSING, PromptsDiffer: DIFFERS}.get(type(exc), NOT_TEXT)

    def encode(self, values: list[Any], where: list[str], ends: list[bool] | None) -> Encoded:
        del ends
        rendered = [self._render(v, w) for v, w in zip(values, where)]
        texts = [text for sides, _ in rendered for text, _ in sides]
        encodings = iter(
            self._tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
            if texts
            else []
        )
        ids, masks, doc = [], [], {k: [] for k in ("chosen_len", "first_c", "first_r", "status")}
        for sides, status in rendered:
            row_ids, row_masks, firsts = [], [], []
            for _, spans in sides:
                enc = next(encodings)
                mask = target_mask(np.asarray(enc.offsets, np.int64).reshape(-1, 2), spans)
                hits = np.flatnonzero(mask)
                row_ids.append(np.asarray(enc.ids, np.int64))
                row_masks.append(mask)
                firsts.append(int(hits[0]) if len(hits) else -1)
            doc["status"].append(status)
            doc["chosen_len"].append(len(row_ids[0]) if row_ids else 0)
            doc["first_c"].append(firsts[0] if firsts else -1)
            doc["first_r"].append(firsts[1] if firsts else -1)
            ids.append(np.concatenate(row_ids) if row_ids else np.zeros(0, np.int64))
            masks.append(np.concatenate(row_masks) if row_masks else np.zeros(0, np.uint8))
        return Encoded(
            tokens=np.concatenate(ids) if ids else np.zeros(0, np.int64),
            lengths=np.array([len(i) for i in ids], np.int64),
            extras={
                "mask": np.concatenate(masks) if masks else np.zeros(0, np.uint8),
                "chosen_len": np.array(doc["chosen_len"], np.int64),
                "first_chosen": np.array(doc["first_c"], np.int64),
                "first_rejected": np.array(doc["first_r"], np.int64),
                "status": np.array(doc["status"], np.int64),
            },
        )


@dataclass
class PairSelection:
    """The pairs of a store that train (`docs`), each side's tokens (`lengths`: (n, 2), whole
    or cut at max_length), and what was dropped, by reason."""

    docs: np.ndarray
    lengths: np.ndarray
    missing: int = 0
    not_text: int = 0
    differs: int = 0
    no_answer: int = 0
    too_long: int = 0
    packed: bool = False  # too long: the two sides together

    @property
    def dropped(self) -> int:
        return self.missing + self.not_text + self.differs + self.no_answer + self.too_long


def select_pairs(
    store: TokenStore, candidates: np.ndarray, max_length: int, cut: bool, packed: bool = False
) -> PairSelection:
    """Of the store's rows `candidates`, the pairs whose two sides keep an answer token within
    `max_length` tokens (`cut`) or fit whole (drop): each side, or packed both together."""
    status = store.doc_extra("status")[candidates]
    total = np.diff(store.doc_offsets)[candidates]
    chosen = store.doc_extra("chosen_len")[candidates]
    sides = np.stack([chosen, total - chosen], 1)  # (n, 2)
    first = np.stack(
        [
            store.doc_extra("first_chosen")[candidates],
            store.doc_extra("first_rejected")[candidates],
        ],
        1,
    )
    ok = status == OK
    no_answer = ok & (first < 0).any(1)
    ok &= ~no_answer
    if packed:
        fits = sides.sum(1) <= max_length
    else:
        fits = (first < max_length).all(1) if cut else (sides <= max_length).all(1)
    keep = ok & fits
    return PairSelection(
        docs=candidates[keep],
        lengths=np.minimum(sides[keep], max_length),
        missing=int((status == MISSING).sum()),
        not_text=int((status == NOT_TEXT).sum()),
        differs=int((status == DIFFERS).sum()),
        no_answer=int((status == NO_ANSWER).sum() + no_answer.sum()),
        too_long=int((ok & ~fits).sum()),
        packed=packed,
    )


class PreferenceSamples:
    """The pairs of `selection` (a map-style dataset): sample i is pair i, its two sides read
    from the memory-mapped store. With `reference` set ((pairs, 2) float64, task.reference=
    precomputed), each sample also carries its pair's reference log-probabilities."""

    def __init__(
        self,
        store: TokenStore,
        selection: PairSelection,
        packed: bool = False,
        reference: np.ndarray | None = None,
    ) -> None:
        self.store, self.selection, self.packed = store, selection, packed
        self.starts = store.doc_offsets[selection.docs]
        self.chosen = store.doc_extra("chosen_len")[selection.docs]
        self.reference = reference

    def with_reference(self, reference: np.ndarray) -> PreferenceSamples:
        """These pairs, each sample carrying its reference log-probabilities ((pairs, 2),
        task.reference=precomputed's pass)."""
        return PreferenceSamples(self.store, self.selection, self.packed, reference)

    def identity(self) -> dict[str, Any]:
        """What the pairs' scored tokens depend on: the store (content-addressed), which of its
        rows train and how long each side is kept, and the layout (padded or packed)."""
        import hashlib

        rows = hashlib.sha256(self.selection.docs.astype("<i8").tobytes())
        rows.update(self.selection.lengths.astype("<i8").tobytes())
        return {"store": str(self.store.root), "rows": rows.hexdigest(), "packed": self.packed}

    def __len__(self) -> int:
        return len(self.selection.docs)

    def sides(self, i: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The (token ids, answer mask) of the chosen side, then the rejected one."""
        out = []
        for k, start in enumerate((int(self.starts[i]), int(self.starts[i] + self.chosen[i]))):
            a, b = start, start + int(self.selection.lengths[i, k])
            out.append(
                (self.store.read(a, b).astype(np.int64), self.store.read_extra("mask", a, b))
            )
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = self._pair(i)
        if self.reference is not None:
            sample[PRECOMPUTED] = torch.from_numpy(self.reference[i].copy())
        return sample

    def _pair(self, i: int) -> dict[str, torch.Tensor]:
        sides = self.sides(i)
        if self.packed:  # one row, two documents (TextSequence aligns: no target crosses)
            row = TextSequence.from_documents(sides)
            side = np.repeat(np.arange(2), [len(t) for t, _ in sides])
            return {**row.as_sample(packed=True), "pair_side": torch.from_numpy(side)}
        rows = [TextSequence.from_documents([s]) for s in sides]
        width = max(len(r.input_ids) for r in rows)
        ids = np.zeros((2, width), np.int64)
        labels = np.full((2, width), IGNORE_INDEX, np.int64)
        for k, r in enumerate(rows):
            ids[k, : len(r.input_ids)] = r.input_ids
            labels[k, : len(r.labels)] = r.labels
        return {"input_ids": torch.from_numpy(ids), "shift_labels": torch.from_numpy(labels)}


def collate(packed: bool = False) -> PadCollate:
    """Pads the pairs of a micro-batch to its longest side, (pairs, 2, T); packed, to its
    longest row, (pairs, T): padding positions 0 (each padding token its own document, after
    the pair's) and `pair_side` -1."""
    pad: dict[str, int] = {"input_ids": 0, "shift_labels": IGNORE_INDEX}
    if packed:
        pad |= {"position_ids": 0, "pair_side": -1}
    return PadCollate(pad=pad)


def _source(path: str) -> tuple[Source, Source | None]:
    train, val = sources(Path(path).expanduser(), "chosen", "data=preference")
    fix = lambda s: dataclasses.replace(s, columns=COLUMNS)  # noqa: E731
    return fix(train), (fix(val) if val is not None else None)


def _check(
    truncation: str, max_length: int | None, val_every_nth: int, packed: bool, bad_rows: str
) -> None:
    # Messages start with the argument's name: the trainer names the config key from it.
    if bad_rows not in BAD_ROWS:
        raise ValueError(
            f"bad_rows must be refuse (a row that is no pair stops the run, named by file and "
            f"line) or drop (such rows are dropped and counted), got {bad_rows!r}"
        )
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be drop or cut, got {truncation!r}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
    if val_every_nth < 2:
        raise ValueError("val_every_nth must be at least 2")
    if packed and truncation == "cut":
        raise ValueError(
            "truncation: cut is for padded pairs (data.packed=false); packed, a pair longer "
            "than data.max_length is dropped (truncation=drop)"
        )


def preference_data(
    path: str,
    val_path: str | None = None,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    max_length: int | None = None,
    truncation: str = "drop",
    packed: bool = False,
    val_every_nth: int = 10,
    bad_rows: str = "refuse",
    pretrained: str | None = None,
    context: int | None = None,
    cache: bool = True,
    tokenize_workers: int | None = None,
    cache_dir: str | None = None,
) -> DataSplits:
    """The `data._target_` of `data=preference` (configs/data/preference.yaml says what each
    key does). `pretrained`, `context`: the model's directory and context."""
    _check(truncation, max_length, val_every_nth, packed, bad_rows)
    if not path or path == "required":
        raise ValueError(
            "path: data=preference needs data.path= a .jsonl, .parquet or save_to_disk dir"
        )
    length = max_length or model_context(pretrained, context)
    if length is None:
        raise ValueError("max_length: the model names no context; set data.max_length=TOKENS")
    if not cache:
        cache_dir = tempfile.mkdtemp(prefix="cumulus-shards-")
    tok, encoder = _encoder(tokenizer, chat_template, pretrained, bad_rows)
    train_src, own_val = _source(path)
    val_src = _source(val_path)[0] if val_path else own_val

    def load(src: Source) -> TokenStore:
        return open_shards(src, None, cache_dir, tokenize_workers, encoder=encoder)

    store, val_store = load(train_src), (load(val_src) if val_src else None)
    every = np.arange(len(store.doc_offsets) - 1)
    if val_store is None:  # every n-th pair validates
        held = every % val_every_nth == 0
        parts = [(store, every[~held]), (store, every[held])]
    else:
        parts = [(store, every), (val_store, np.arange(len(val_store.doc_offsets) - 1))]
    # Drops are said of whole files: data.path's every row, the held-out ones too.
    whole = [(store, every)] + ([parts[1]] if val_store is not None else [])
    train, val, *files = (
        PreferenceSamples(s, select_pairs(s, c, length, truncation == "cut", packed), packed)
        for s, c in [*parts, *whole]
    )
    if not len(train):
        raise UserError(_nothing(path, files[0].selection, length))
    if not len(val):
        where = val_path or path
        raise UserError(
            f"data.{'val_path' if val_path else 'path'}: {where} leaves no validation pair "
            f"(data.val_every_nth={val_every_nth}): {_dropped(val.selection) or 'no rows'}; "
            "give more rows, or data.val_path="
        )
    return DataSplits(
        train=train,
        val=val,
        collate_fn=collate(packed),
        vocab_size=max(len(tok), store.max_id + 1),
        seq_len=length,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        description=_description(path, store, (train, val), files, length),
    )


def _encoder(
    tokenizer: str | None, template_file: str | None, pretrained: str | None, bad_rows: str
) -> tuple[Any, PreferenceEncoder]:
    tok_path = tokenizer_source(tokenizer, pretrained)
    if tok_path is None:
        where = f"; model.pretrained={pretrained} holds none" if pretrained else ""
        raise UserError(
            "data.tokenizer: data=preference renders pairs with a tokenizer's chat template: "
            "set data.tokenizer=DIR (a tokenizer directory), or model.pretrained=DIR holding "
            f"one{where}"
        )
    tok = load_hf_tokenizer(tok_path, "data.tokenizer" if tokenizer else "model.pretrained")
    template = chat_template(tok, template_file, tok_path)
    origin = "data.chat_template" + ("" if template_file else f" (the template of {tok_path})")
    return tok, PreferenceEncoder(str(tok_path), template, origin, bad_rows)


def _dropped(sel: PairSelection) -> str:
    parts = [
        (sel.missing, "without chosen or rejected"),
        (sel.not_text, "whose content is not text messages"),
        (sel.differs, "whose chosen and rejected prompts differ"),
        (sel.no_answer, "with no answer after the prompt"),
        (
            sel.too_long,
            "whose two sides together are longer than data.max_length"
            if sel.packed
            else "with a side longer than data.max_length",
        ),
    ]
    said = [f"{n} {why}" for n, why in parts if n]
    return f"{sel.dropped} pairs dropped ({', '.join(said)})" if said else ""


def _nothing(path: str, sel: PairSelection, length: int) -> str:
    return (
        f"data.path: {path} holds no pair to train on: {_dropped(sel) or 'it has no rows'} "
        f"(data.max_length={length}; data.truncation=cut keeps each side's first tokens). "
        f"{EXPECTED}."
    )


def _description(
    path: str,
    store: TokenStore,
    splits: tuple[PreferenceSamples, PreferenceSamples],
    files: list[PreferenceSamples],
    length: int,
) -> str:
    """`files`: data.path's rows, and data.val_path's if given (their drops are said)."""
    train, val = splits
    said = [_dropped(f.selection) for f in files]
    dropped = "".join(
        f"; {'data.val_path: ' if k else ''}{text}" for k, text in enumerate(said) if text
    )
    cache = "token cache reused: " if store.reused else "tokenized into "
    return (
        f"{len(train)} train / {len(val)} val pairs from {path}{dropped}, "
        f"{'each pair one row' if train.packed else 'each side'} of at most {length} tokens "
        f"({cache}{store.root})"
    )
