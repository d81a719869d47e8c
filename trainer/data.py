"""Language-modelling data: text or token files -> samples -> the micro-batches of each step.

The samples of optimizer step `s` are a pure function of (seed, s, global batch size): an
epoch-wise permutation of all samples, read as one endless stream, global batch after global
batch. Any split into ranks x micro-batches x accumulation therefore sees the same global
batch, and resuming at step `s` needs no loader state at all.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.config import DataCfg
from trainer.errors import UserError
from trainer.gpt import IGNORE_INDEX

Batch = tuple[torch.Tensor, torch.Tensor]


class Samples:
    """Variable-length token samples: sample i is `tokens[start_i : start_i + length_i]`."""

    def __init__(self, tokens: torch.Tensor, spans: torch.Tensor) -> None:
        self.tokens = tokens  # (N_tokens,) integer
        self.spans = spans  # (N, 2) int64: start, length

    def __len__(self) -> int:
        return self.spans.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        start, length = self.spans[i].tolist()
        return self.tokens[start : start + length].long()


def packed_spans(n_tokens: int, block_size: int) -> torch.Tensor:
    """Fixed blocks of block_size+1 tokens (inputs + shifted targets), stride block_size."""
    n = max(0, (n_tokens - 1) // block_size)
    starts = torch.arange(n, dtype=torch.int64) * block_size
    return torch.stack([starts, torch.full_like(starts, block_size + 1)], dim=1)


def paragraph_spans(
    text: bytes, offset: int, block_size: int, min_len: int
) -> list[tuple[int, int]]:
    """One sample per paragraph (split after blank lines), long ones cut at block_size+1."""
    spans = []
    pos = 0
    for para in text.split(b"\n\n"):
        length = len(para) + 2  # keep the separator: samples still read as source text
        for start in range(pos, pos + min(length, len(text) - pos), block_size + 1):
            n = min(block_size + 1, pos + length - start, len(text) - start)
            if n >= min_len:
                spans.append((offset + start, n))
        pos += length
    return spans


def chunk_spans(n_tokens: int, block_size: int, min_len: int, seed: int = 0) -> torch.Tensor:
    """Variable-length chunks for token streams without paragraph structure (deterministic)."""
    rng = np.random.default_rng(seed)
    spans, pos = [], 0
    while pos + min_len <= n_tokens:
        n = int(min(rng.integers(min_len, block_size + 2), n_tokens - pos))
        spans.append((pos, n))
        pos += n
    return torch.tensor(spans, dtype=torch.int64).reshape(-1, 2)


def _read_text_files(files: list[Path], cfg: DataCfg) -> Samples:
    blobs = [f.read_bytes() for f in files]
    tokens = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    if cfg.packed:
        return Samples(tokens, packed_spans(len(tokens), cfg.block_size))
    spans, offset = [], 0
    for blob in blobs:
        spans += paragraph_spans(blob, offset, cfg.block_size, cfg.min_sample_len)
        offset += len(blob)
    return Samples(tokens, torch.tensor(spans, dtype=torch.int64).reshape(-1, 2))


def _token_samples(tokens: torch.Tensor, cfg: DataCfg) -> Samples:
    if cfg.packed:
        return Samples(tokens, packed_spans(len(tokens), cfg.block_size))
    return Samples(tokens, chunk_spans(len(tokens), cfg.block_size, cfg.min_sample_len))


def _load_bin(path: Path) -> torch.Tensor:
    if path.stat().st_size % 2:
        raise UserError(
            f"data.path: {path} is not a uint16 token file (odd size {path.stat().st_size} bytes); "
            "a .bin must hold little-endian uint16 token ids as written by nanoGPT's prepare.py"
        )
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int32))


@dataclass
class Splits:
    train: Samples
    val: Samples
    vocab_size: int  # smallest vocabulary that covers the data
    description: str


def load_splits(cfg: DataCfg) -> Splits:
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
            int(max(train.max(), val.max())) + 1,
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
        cut = len(tokens) - len(tokens) // cfg.val_every_nth
        return Splits(
            _token_samples(tokens[:cut], cfg),
            _token_samples(tokens[cut:], cfg),
            int(tokens.max()) + 1,
            f"tokens from {path}",
        )
    data = path.read_bytes()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    cut = len(tokens) - len(tokens) // cfg.val_every_nth
    return Splits(
        _token_samples(tokens[:cut], cfg), _token_samples(tokens[cut:], cfg), 256, f"text {path}"
    )


def _split_files(files: list[Path], cfg: DataCfg, description: str) -> Splits:
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


class GlobalBatchSampler:
    """Sample indices of each optimizer step's global batch: a pure function of
    (seed, step, global_batch_size)."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if num_samples == 0:
            raise UserError("data: the training split holds no samples; use more or longer text")
        self.n = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def global_indices(self, step: int) -> np.ndarray:
        positions = np.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)
        epochs, offsets = np.divmod(positions, self.n)
        return np.array([self._perm(int(e))[o] for e, o in zip(epochs, offsets)])

    def epoch(self, step: int) -> float:
        return step * self.global_batch_size / self.n


class TrainBatches:
    """This rank's micro-batches for a given optimizer step.

    The global batch is laid out rank-major: rank r owns the r-th contiguous share, cut into
    `grad_accum_steps` micro-batches of `micro_batch_size` samples.
    """

    def __init__(
        self,
        samples: Samples,
        sampler: GlobalBatchSampler,
        *,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        device: torch.device,
    ) -> None:
        self.samples = samples
        self.sampler = sampler
        self.rank = rank
        self.micro = micro_batch_size
        self.accum = grad_accum_steps
        self.device = device
        assert sampler.global_batch_size == micro_batch_size * grad_accum_steps * world_size

    def window(self, step: int) -> list[Batch]:
        share = self.micro * self.accum
        mine = self.sampler.global_indices(step)[self.rank * share : (self.rank + 1) * share]
        return [
            self._to_device(collate([self.samples[int(i)] for i in mine[k : k + self.micro]]))
            for k in range(0, share, self.micro)
        ]

    def _to_device(self, batch: Batch) -> Batch:
        pin = self.device.type == "cuda"
        return tuple(
            (t.pin_memory() if pin else t).to(self.device, non_blocking=pin) for t in batch
        )  # type: ignore[return-value]


def eval_set_size(n_samples: int, batch_size: int, max_batches: int | None) -> int:
    """How many validation samples an evaluation covers, over all ranks."""
    return n_samples if max_batches is None else min(n_samples, max_batches * batch_size)


def eval_batches(
    samples: Samples,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    max_batches: int | None,
    device: torch.device,
) -> list[Batch]:
    """This rank's share of the validation set, the same set for any world size.

    The set is the first `max_batches * batch_size` samples (or all); rank r takes every
    world_size-th sample from r, so shards differ by at most one sample and none repeats.
    """
    mine = list(range(rank, eval_set_size(len(samples), batch_size, max_batches), world_size))
    return [
        tuple(t.to(device) for t in collate([samples[i] for i in mine[k : k + batch_size]]))
        for k in range(0, len(mine), batch_size)
    ]  # type: ignore[misc]
