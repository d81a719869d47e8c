"""`data=prompts`: the prompts `task=grpo` generates from, with the fields its rewards read.

Rows from JSON Lines, Parquet or a `save_to_disk` directory, each with a `prompt`: a string
(one user message) or a list of messages. The prompt is rendered with the chat template as
data=chat renders a prompt (trainer/data/chat_render.py; its generation prompt added, so the
model continues as the assistant) and tokenized once per job by the corpus machinery
(trainer/data/shards.py, cached like data=chat's, keyed by the files, the tokenizer and the
template). The row's other fields (`answer`, ...) are kept beside it for the reward functions
(trainer/rollout/rewards.py), read from the same rows in the same order when the data is
opened (they are not tokens). A row without a `prompt`, or whose prompt is not text
messages, is refused in one paragraph naming the file and line.

A sample is `{"input_ids": (P,), "index": ()}`: the prompt's tokens and its row (its fields:
`PromptSamples.row(index)`); a micro-batch pads the prompts on the right, with
`prompt_lengths` (B,). Opening the data checks that `max_new_tokens` fits the model's context
and that every prompt leaves room for it (`data.truncation=error`, one paragraph naming the
longest prompt; `drop`: such prompts are dropped and counted).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config.errors import UserError
from trainer.data import DataSplits
from trainer.data.chat import model_context
from trainer.data.chat_render import Renderer, chat_template
from trainer.data.chat_rows import message_list
from trainer.data.encoding import Encoded, text_identity, tokenizer_files_identity
from trainer.data.hf import sources
from trainer.data.shards import Source, TokenStore, chunk_values, chunks, load_saved, open_shards
from trainer.data.tokenize import load_hf_tokenizer, tokenizer_source

VERSION = "prompts/1"
PROMPT = "prompt"
TRUNCATION = ("error", "drop")
HINT = 'data=prompts reads rows with a "prompt": a string (a user message) or a list of messages.'


def prompt_messages(record: Any, where: str) -> list[dict[str, Any]]:
    """A row's prompt as messages (a string: one user message); BadRecord otherwise."""
    from trainer.data.encoding import BadRecord

    if not isinstance(record, dict) or record.get(PROMPT) is None:
        fields = ", ".join(map(repr, record)) if isinstance(record, dict) else "none"
        raise BadRecord(f'data.path: {where} has no "prompt" (its fields: {fields}).', HINT)
    return message_list(record[PROMPT], where, PROMPT, "user")


@dataclass
class PromptEncoder:
    """The corpus machinery's encoder of prompt rows (trainer/data/encoding.py's `Encoder`):
    one document per row, the prompt rendered with its generation prompt."""

    tokenizer: str
    template: str
    origin: str
    extras: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._tok: Any = None
        self._renderer: Renderer | None = None

    def identity(self) -> dict[str, Any]:
        return {
            "encoder": VERSION,
            "tokenizer": tokenizer_files_identity(self.tokenizer),
            "template": text_identity(self.template),
        }

    def vocab_size(self) -> int:
        if self._tok is None:
            self._tok = load_hf_tokenizer(self.tokenizer)
        return len(self._tok)

    def start(self) -> None:
        if self._tok is None:
            self._tok = load_hf_tokenizer(self.tokenizer)
        self._renderer = Renderer(self.template, dict(self._tok.special_tokens_map), self.origin)

    def render(self, record: Any, where: str) -> str:
        """The prompt as the model sees it: the template with its generation prompt."""
        assert self._renderer is not None, "start() first"
        (text,), _ = self._renderer.apply_template([prompt_messages(record, where)], True, where)
        return text

    def encode(self, values: list[Any], where: list[str], ends: list[bool] | None) -> Encoded:
        del ends
        texts = [self.render(v, w) for v, w in zip(values, where)]
        encodings = self._tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        ids = [np.asarray(e.ids, np.int64) for e in encodings]
        return Encoded(
            tokens=np.concatenate(ids) if ids else np.zeros(0, np.int64),
            lengths=np.array([len(i) for i in ids], np.int64),
        )


def end_token_ids(tok: Any, template: str, origin: str) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's end-of-sequence token and the one the
    template writes right after an assistant message (its end of turn), if special."""
    ends = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
    renderer = Renderer(template, dict(tok.special_tokens_map), origin)
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "PROBE"}]
    (text,), _ = renderer.apply_template([probe], False, "the end-of-turn probe")
    after = text[text.rfind("PROBE") + len("PROBE") :]
    ids = tok.backend_tokenizer.encode(after, add_special_tokens=False).ids
    specials = set(tok.all_special_ids) | {int(i) for i in tok.added_tokens_decoder}
    if ids and ids[0] in specials and ids[0] not in ends:
        ends.append(int(ids[0]))
    return tuple(ends)


class PromptSamples:
    """The prompts of a store that fit (`docs`, store indices), as a map-style dataset; each
    prompt's row (its raw `prompt` and other fields) from `rows`."""

    def __init__(self, store: TokenStore, docs: np.ndarray, rows: Sequence[dict[str, Any]]) -> None:
        self.store, self.docs, self.rows = store, docs, rows
        self.starts = store.doc_offsets[docs]
        self.lengths = np.diff(store.doc_offsets)[docs]
        self.dropped = 0  # prompts too long for the context (data.truncation=drop)
        self.end_ids: tuple[int, ...] = ()  # the tokens that end a completion
        # A completion's text for the rewards (special tokens left out, as TRL decodes).
        self.decode_text: Any = None

    @property
    def fields(self) -> list[str]:
        """The row fields the prompts have (every row's, in first-seen order)."""
        return list(dict.fromkeys(k for r in self.rows for k in r))

    def __len__(self) -> int:
        return len(self.docs)

    def tokens(self, i: int) -> np.ndarray:
        a = int(self.starts[i])
        return self.store.read(a, a + int(self.lengths[i])).astype(np.int64)

    def row(self, i: int) -> dict[str, Any]:
        """Sample i's row as the reward functions see it: `prompt` and the other fields."""
        return self.rows[int(self.docs[i])]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # The completions' random stream: drawn from the generators the loader seeds from
        # (seed, step, the sample's position in the global batch) for each sample
        # (trainer/data/loader.py `SeededSamples`), so it depends on neither the rank nor
        # the micro-batch the prompt lands in, and two draws of one row in a step differ.
        stream = torch.randint(0, 2**62, (), dtype=torch.int64)
        return {
            "input_ids": torch.from_numpy(self.tokens(i)),
            "index": torch.tensor(i),
            "stream": stream,
        }


def collate_prompts(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Prompts padded on the right with 0: `input_ids` (B, P), `prompt_lengths` (B,),
    `index` (B,) (each sample's row), `stream` (B,) (its completions' random stream)."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.int64)
    for k, s in enumerate(samples):
        ids[k, : len(s["input_ids"])] = s["input_ids"]
    return {
        "input_ids": ids,
        "prompt_lengths": torch.tensor([len(s["input_ids"]) for s in samples]),
        "index": torch.stack([s["index"] for s in samples]),
        "stream": torch.stack([s["stream"] for s in samples]),
    }


def read_rows(source: Source) -> list[dict[str, Any]]:
    """Every row of `source` with all its fields, in the order the shards hold them."""
    path = source.paths[0]
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        source = dataclasses.replace(source, columns=tuple(pq.ParquetFile(path).schema_arrow.names))
    elif source.kind == "saved":
        ds = load_saved(path)
        ds = ds[source.split] if source.split is not None else ds
        source = dataclasses.replace(source, columns=tuple(ds.column_names))
    rows: list[dict[str, Any]] = []
    for chunk in chunks(source):
        rows += chunk_values(chunk, path, source)[0]
    return rows


def _check(truncation: str, val_every_nth: int, max_new_tokens: int) -> None:
    # Messages start with the argument's name: the trainer names the config key from it.
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be error or drop, got {truncation!r}")
    if val_every_nth < 2:
        raise ValueError("val_every_nth must be at least 2")
    if not (isinstance(max_new_tokens, int) and max_new_tokens > 0):
        raise ValueError(f"max_new_tokens must be a positive number, got {max_new_tokens!r}")


def _source(path: str) -> tuple[Source, Source | None]:
    train, val = sources(Path(path).expanduser(), PROMPT, "data=prompts")
    fix = lambda s: dataclasses.replace(s, columns=(PROMPT,))  # noqa: E731
    return fix(train), (fix(val) if val is not None else None)


def _encoder(tokenizer: str | None, template_file: str | None, pretrained: str | None) -> tuple:
    tok_path = tokenizer_source(tokenizer, pretrained)
    if tok_path is None:
        where = f"; model.pretrained={pretrained} holds none" if pretrained else ""
        raise UserError(
            "data.tokenizer: data=prompts renders prompts with a tokenizer's chat template: "
            "set data.tokenizer=DIR (a tokenizer directory), or model.pretrained=DIR holding "
            f"one{where}"
        )
    tok = load_hf_tokenizer(tok_path, "data.tokenizer" if tokenizer else "model.pretrained")
    template = chat_template(tok, template_file, tok_path)
    origin = "data.chat_template" + ("" if template_file else f" (the template of {tok_path})")
    return tok, PromptEncoder(str(tok_path), template, origin)


def prompts_data(
    path: str,
    val_path: str | None = None,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    max_new_tokens: int = 256,
    truncation: str = "error",
    val_every_nth: int = 10,
    pretrained: str | None = None,
    context: int | None = None,
    cache: bool = True,
    tokenize_workers: int | None = None,
    cache_dir: str | None = None,
) -> DataSplits:
    """The `data._target_` of `data=prompts` (configs/data/prompts.yaml says what each key
    does). `pretrained`, `context`: the model's directory and context; `max_new_tokens`: the
    completions' longest, which every prompt must leave room for."""
    _check(truncation, val_every_nth, max_new_tokens)
    if not path or path == "required":
        raise ValueError(
            "path: data=prompts needs data.path= a .jsonl, .parquet or save_to_disk dir"
        )
    limit = _prompt_limit(model_context(pretrained, context), max_new_tokens)
    if not cache:
        cache_dir = tempfile.mkdtemp(prefix="cumulus-shards-")
    tok, encoder = _encoder(tokenizer, chat_template, pretrained)
    train_src, own_val = _source(path)
    val_src = _source(val_path)[0] if val_path else own_val

    def load(src: Source) -> tuple[TokenStore, list[dict[str, Any]]]:
        store = open_shards(src, None, cache_dir, tokenize_workers, encoder=encoder)
        return store, read_rows(src)

    store, rows = load(train_src)
    every = np.arange(len(store.doc_offsets) - 1)
    if val_src is None:  # every n-th prompt validates
        held = every % val_every_nth == 0
        parts = [(store, rows, every[~held], path), (store, rows, every[held], path)]
    else:
        val_store, val_rows = load(val_src)
        parts = [(store, rows, every, path)]
        parts.append((val_store, val_rows, np.arange(len(val_rows)), str(val_path or path)))
    ends = end_token_ids(tok, encoder.template, encoder.origin)
    splits = [_fitting(s, r, docs, limit, truncation, where) for s, r, docs, where in parts]
    train, val = splits
    for split in splits:
        split.end_ids = ends
        split.decode_text = lambda ids: tok.decode(ids, skip_special_tokens=True)
    if not len(train) or not len(val):
        raise UserError(
            f"data.{'val_path' if val_path and len(train) else 'path'}: {val_path or path} leaves "
            f"no {'validation ' if len(train) else ''}prompt (data.val_every_nth="
            f"{val_every_nth}, {train.dropped} dropped as too long); give more rows"
        )
    longest = int(max(train.lengths.max(), val.lengths.max()))
    return DataSplits(
        train=train,
        val=val,
        collate_fn=collate_prompts,
        vocab_size=max(len(tok), store.max_id + 1),
        seq_len=longest + max_new_tokens,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        description=_description(path, store, train, val, max_new_tokens),
    )


def _prompt_limit(context: int | None, max_new_tokens: int) -> int | None:
    """The longest prompt that leaves `max_new_tokens` in the context (None: no limit)."""
    if context is None:
        return None
    if max_new_tokens >= context:
        raise UserError(
            f"data.max_new_tokens: {max_new_tokens} new tokens do not fit the model's context of "
            f"{context} tokens with any prompt (a prompt and its completion share the context); "
            f"generate fewer (task.max_new_tokens < {context}), or use a model with a longer "
            "context"
        )
    return context - max_new_tokens


def _fitting(
    store: TokenStore,
    rows: list[dict[str, Any]],
    docs: np.ndarray,
    limit: int | None,
    truncation: str,
    path: str,
) -> PromptSamples:
    """The prompts of `docs` within `limit` tokens; longer ones refused (error) or dropped."""
    if len(rows) != len(store.doc_offsets) - 1:  # the same rows in the same order, or a bug
        raise UserError(
            f"data.path: {path} read {len(rows)} rows but its shards hold "
            f"{len(store.doc_offsets) - 1}; delete its token cache ({store.root})"
        )
    lengths = np.diff(store.doc_offsets)[docs]
    fits = np.ones(len(docs), bool) if limit is None else lengths <= limit
    if truncation == "error" and not fits.all():
        worst = int(docs[np.argmax(lengths)])
        raise UserError(
            f"data.path: {int((~fits).sum())} prompts of {path} leave no room for the "
            f"completion: the longest (row {worst + 1}) has {int(lengths.max())} tokens, and a "
            f"prompt may have {limit} (the model's context less data.max_new_tokens). Shorten "
            "them, generate fewer tokens, or drop them: data.truncation=drop (counted)"
        )
    samples = PromptSamples(store, docs[fits], rows)
    samples.dropped = int((~fits).sum())
    return samples


def _description(
    path: str, store: TokenStore, train: PromptSamples, val: PromptSamples, max_new: int
) -> str:
    dropped = f"; {train.dropped} dropped (too long)" if train.dropped else ""
    cache = "token cache reused: " if store.reused else "tokenized into "
    return (
        f"{len(train)} train / {len(val)} val prompts from {path}{dropped}, up to "
        f"{int(train.lengths.max())} tokens + {max_new} generated ({cache}{store.root})"
    )
