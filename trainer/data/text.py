"""Language-modelling data from text or token files: `data=stdlib` (the default), or
`data._target_=trainer.data.text.text_data` with `path=` a text file, a directory of text
files, or uint16 token `.bin` files.

Samples are token spans; `collate` pads them into `(inputs, targets)` pairs for
`task=causal_lm`, padding targets with -100 (not loss items).
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.tasks import IGNORE_INDEX
from trainer.config.errors import UserError
from trainer.data import DataSplits
from trainer.data.shards import HOME_CACHE, Source, TokenView, open_shards

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class TextCfg:
    """Where the text comes from and how it is cut into samples.

    `path`: `stdlib` (this Python's standard-library sources, no download), a text file, a
    directory of text files matched by `glob`, or a uint16 token `.bin` file (or a directory
    holding train.bin and val.bin). `packed`: fixed blocks of block_size+1 tokens; false:
    one variable-length sample per paragraph (or random-length chunks of tokens), padded per
    micro-batch. `val_every_nth`: every n-th file is held out (for one file: its last 1/n).
    """

    path: str = "stdlib"
    glob: str = "*.py"
    packed: bool = True
    block_size: int = 128
    val_every_nth: int = 10
    min_sample_len: int = 8
    tokenizer: str | None = None
    # With a tokenizer: tokenizer processes (null: the cores available) and where the token
    # shards go (null: next to the data, or ~/.cache/cumulus/shards).
    tokenize_workers: int | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        # Messages start with the argument's name: the trainer names the config key from it.
        if not self.path:
            raise ValueError("path must name a file or directory, or be `stdlib`")
        if self.path == "required":
            raise ValueError(
                "path: this experiment needs a token dataset: pass data.path=DIR holding "
                "train.bin and val.bin (uint16 token ids; `python scripts/prepare_bin.py DIR` "
                "writes them)"
            )
        if self.block_size <= 0:
            raise ValueError(f"block_size must be a positive number, got {self.block_size}")
        if self.val_every_nth < 2:
            raise ValueError("val_every_nth must be at least 2")
        if self.tokenize_workers is not None and self.tokenize_workers < 0:
            raise ValueError(f"tokenize_workers must be >= 0 or null, got {self.tokenize_workers}")
        if not 2 <= self.min_sample_len <= self.block_size + 1:
            raise ValueError(
                f"min_sample_len must be in [2, data.block_size + 1], got {self.min_sample_len}"
            )


class Samples:
    """Variable-length token samples: sample i is `tokens[start_i : start_i + length_i]`.

    `tokens`: a tensor, a NumPy array (a memory map), or a `TokenView` of token shards: only
    the samples read are paged in, so memory does not grow with the corpus."""

    def __init__(self, tokens: torch.Tensor | np.ndarray | TokenView, spans: torch.Tensor) -> None:
        self.tokens = tokens  # (N_tokens,) integer
        self.spans = spans  # (N, 2) int64: start, length

    def __len__(self) -> int:
        return self.spans.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        start, length = self.spans[i].tolist()
        if isinstance(self.tokens, torch.Tensor):
            return self.tokens[start : start + length].long()
        if isinstance(self.tokens, TokenView):
            return torch.from_numpy(self.tokens.read(start, start + length).astype(np.int64))
        return torch.from_numpy(np.asarray(self.tokens[start : start + length], dtype=np.int64))


def packed_spans(n_tokens: int, block_size: int) -> torch.Tensor:
    """Fixed blocks of block_size+1 tokens (inputs + shifted targets), stride block_size."""
    n = max(0, (n_tokens - 1) // block_size)
    starts = torch.arange(n, dtype=torch.int64) * block_size
    return torch.stack([starts, torch.full_like(starts, block_size + 1)], dim=1)


def paragraph_bounds(text: bytes) -> np.ndarray:
    """Where each paragraph of `text` starts, and its end: 0, the position after every blank
    line (b"\n\n", found left to right without overlap, as `bytes.split` finds them), and
    len(text). Each paragraph keeps its separator: samples still read as source text."""
    a = np.frombuffer(text, dtype=np.uint8)
    pair = np.flatnonzero((a[:-1] == 10) & (a[1:] == 10))  # every "\n\n", overlapping
    if len(pair):
        # A run of k newlines holds k-1 overlapping pairs; the split takes every other one.
        first = np.ones(len(pair), dtype=bool)
        first[1:] = np.diff(pair) != 1
        run_start = pair[np.maximum.accumulate(np.where(first, np.arange(len(pair)), 0))]
        pair = pair[(pair - run_start) % 2 == 0]
    return np.concatenate([[0], pair + 2, [len(a)]]).astype(np.int64)


def document_spans(offsets: np.ndarray, block_size: int, min_len: int) -> torch.Tensor:
    """One sample per document (`offsets` are their boundaries), long ones cut into pieces of
    block_size+1 tokens; pieces shorter than `min_len` are dropped."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    pieces = -(-lengths // (block_size + 1))  # per document, in order
    doc = np.repeat(np.arange(len(lengths)), pieces)
    first = np.concatenate([[0], np.cumsum(pieces)])[:-1]
    k = np.arange(len(doc)) - np.repeat(first, pieces)  # piece number within its document
    starts = offsets[:-1][doc] + k * (block_size + 1)
    n = np.minimum(block_size + 1, offsets[1:][doc] - starts)
    keep = n >= min_len
    return torch.from_numpy(np.stack([starts[keep], n[keep]], axis=1).astype(np.int64))


def token_samples(
    tokens: np.ndarray | TokenView, offsets: np.ndarray, packed: bool, block_size: int, min_len: int
) -> Samples:
    """Samples of tokenized documents: packed blocks across document boundaries, or one
    (padded) sample per document."""
    if packed:
        return Samples(tokens, packed_spans(len(tokens), block_size))
    return Samples(tokens, document_spans(offsets, block_size, min_len))


def chunk_spans(n_tokens: int, block_size: int, min_len: int, seed: int = 0) -> torch.Tensor:
    """Variable-length chunks for token streams without paragraph structure (deterministic)."""
    rng = np.random.default_rng(seed)
    spans, pos = [], 0
    while pos + min_len <= n_tokens:
        n = int(min(rng.integers(min_len, block_size + 2), n_tokens - pos))
        spans.append((pos, n))
        pos += n
    return torch.tensor(spans, dtype=torch.int64).reshape(-1, 2)


def _shards(source: Source, cfg: TextCfg) -> TokenView:
    """Text tokenized once per job into memory-mapped shards (`trainer.data.shards`)."""
    cache_dir = cfg.cache_dir
    if cache_dir is None and cfg.path == "stdlib":
        cache_dir = str(HOME_CACHE)  # never write into the Python installation
    return TokenView(open_shards(source, cfg.tokenizer, cache_dir, cfg.tokenize_workers))


def _read_text_files(files: list[Path], cfg: TextCfg) -> Samples:
    if cfg.tokenizer:  # one document per file
        view = _shards(Source("files", tuple(files)), cfg)
        return token_samples(view, view.offsets(), cfg.packed, cfg.block_size, cfg.min_sample_len)
    blobs = [f.read_bytes() for f in files]
    tokens = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    if cfg.packed:
        return Samples(tokens, packed_spans(len(tokens), cfg.block_size))
    # One sample per paragraph (split after blank lines), long ones cut at block_size+1: the
    # paragraphs of all files as one list of boundaries (each file's end is the next's start).
    starts = np.cumsum([0] + [len(b) for b in blobs])[:-1]
    bounds = [paragraph_bounds(b)[1:] + start for b, start in zip(blobs, starts)]
    offsets = np.concatenate([np.zeros(1, np.int64), *bounds])
    return Samples(tokens, document_spans(offsets, cfg.block_size, cfg.min_sample_len))


def _token_samples(tokens: Any, cfg: TextCfg, lo: int = 0, hi: int | None = None) -> Samples:
    """Samples of tokens lo..hi-1 (a tensor, memory map or shard view; not copied)."""
    n = len(tokens) - lo if hi is None else hi - lo
    if cfg.packed:
        spans = packed_spans(n, cfg.block_size)
    else:
        spans = chunk_spans(n, cfg.block_size, cfg.min_sample_len)
    spans[:, 0] += lo
    return Samples(tokens, spans)


def _cut(tokens: Any, cfg: TextCfg) -> tuple[Samples, Samples]:
    """The last 1/val_every_nth of a token stream validates."""
    cut = len(tokens) - len(tokens) // cfg.val_every_nth
    return _token_samples(tokens, cfg, 0, cut), _token_samples(tokens, cfg, cut)


def _load_bin(path: Path) -> np.ndarray:
    if path.stat().st_size % 2:
        raise UserError(
            f"data.path: {path} is not a uint16 token file (odd size {path.stat().st_size} bytes); "
            "a .bin must hold little-endian uint16 token ids as written by nanoGPT's prepare.py"
        )
    if path.stat().st_size == 0:
        return np.zeros(0, dtype="<u2")
    return np.memmap(path, dtype="<u2", mode="r")  # paged in as samples are read


@dataclass
class Splits:
    train: Samples
    val: Samples
    vocab_size: int  # smallest vocabulary that covers the data
    description: str


def load_splits(cfg: TextCfg) -> Splits:
    """Read `cfg.path` into train and validation samples; bad paths are a UserError."""
    if cfg.path == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return _split_files(sorted(root.glob(cfg.glob)), cfg, f"Python {root.name} stdlib sources")
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise UserError(
            f"data.path: {path} does not exist. Valid: `stdlib` (this Python's standard library "
            "sources), a text file, a directory of text files matched by data.glob, or a uint16 "
            "token .bin file (or a directory holding train.bin and val.bin)."
        )
    if path.is_dir() and (path / "train.bin").is_file() and (path / "val.bin").is_file():
        train, val = _load_bin(path / "train.bin"), _load_bin(path / "val.bin")
        return Splits(
            _token_samples(train, cfg),
            _token_samples(val, cfg),
            int(max(train.max(initial=0), val.max(initial=0))) + 1,
            f"tokens from {path}/{{train,val}}.bin",
        )
    if path.is_dir():
        files = sorted(p for p in path.glob(cfg.glob) if p.is_file())
        if len(files) < 2:
            raise UserError(
                f"data.path: directory {path} has {len(files)} file(s) matching data.glob="
                f"{cfg.glob!r}; need at least 2 (one or more held out for validation). "
                "Use data.glob= (e.g. '**/*.txt') or point data.path at a single file."
            )
        return _split_files(files, cfg, f"{len(files)} files under {path}")
    if path.suffix == ".bin":
        tokens = _load_bin(path)
        return Splits(*_cut(tokens, cfg), int(tokens.max(initial=0)) + 1, f"tokens from {path}")
    if cfg.tokenizer:  # one document, tokenized in pieces into shards
        view = _shards(Source("text", (path,)), cfg)
        return Splits(*_cut(view, cfg), view.store.max_id + 1, f"{path}")
    size = path.stat().st_size
    tokens = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    return Splits(*_cut(tokens, cfg), 256, f"text {path}")


def _split_files(files: list[Path], cfg: TextCfg, description: str) -> Splits:
    val = [f for i, f in enumerate(files) if i % cfg.val_every_nth == 0]
    train = [f for i, f in enumerate(files) if i % cfg.val_every_nth != 0]
    return Splits(_read_text_files(train, cfg), _read_text_files(val, cfg), 256, description)


def collate(samples: list[torch.Tensor]) -> Batch:
    """Pad to the longest sample; inputs pad with 0, targets with IGNORE_INDEX."""
    length = max(len(s) for s in samples)
    padded = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.int64)  # (B, L)
    for row, s in zip(padded, samples):
        row[: len(s)] = s
    inputs = padded[:, :-1].clamp(min=0)
    targets = padded[:, 1:].clone()
    return inputs, targets


def decode_bytes(ids: list[int]) -> str:
    """Byte tokens (0-255) as text; special ids above 255 are dropped."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def text_data(
    path: str = "stdlib",
    glob: str = "*.py",
    packed: bool = True,
    block_size: int = 128,
    val_every_nth: int = 10,
    min_sample_len: int = 8,
    tokenizer: str | None = None,
    tokenize_workers: int | None = None,
    cache_dir: str | None = None,
    pretrained: str | None = None,
) -> DataSplits:
    """The `data._target_` of `data=stdlib`: `TextCfg`'s fields as keyword arguments.
    `tokenizer`: a tokenizer.json (or tokenizer directory) for text files; with `.bin` token
    files it only decodes the text samples. `pretrained`: the model's directory, whose
    tokenizer is the default (`model.pretrained`)."""
    from trainer.data.tokenize import pretrained_tokenizer

    tokenizer = pretrained_tokenizer(tokenizer, pretrained)
    cfg = TextCfg(
        path,
        glob,
        packed,
        block_size,
        val_every_nth,
        min_sample_len,
        tokenizer,
        tokenize_workers,
        cache_dir,
    )
    splits = load_splits(cfg)
    decode = decode_bytes if splits.vocab_size <= 256 else None
    vocab = splits.vocab_size
    if tokenizer:
        from trainer.data.tokenize import decoder, load_tokenizer

        tok = load_tokenizer(tokenizer)
        decode, vocab = decoder(tok), max(vocab, tok.get_vocab_size())
    return DataSplits(
        train=splits.train,
        val=splits.val,
        collate_fn=collate,
        vocab_size=vocab,
        seq_len=cfg.block_size,
        decode=decode,
        description=splits.description + (f", tokenizer {tokenizer}" if tokenizer else ""),
    )
