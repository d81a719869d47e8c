"""Corpora tokenized once per job, in parallel, in bounded memory, into memory-mapped shards.

One pipeline behind `data=hf`, text files with `data.tokenizer`, and `scripts/prepare_bin.py`:

- records are streamed (JSON Lines line by line, Parquet record batches of the text column,
  `save_to_disk` Arrow tables memory-mapped, text files in pieces) and cut into chunks of
  about `CHUNK_BYTES` of source text, at the same places every time;
- worker processes (`data.tokenize_workers`) tokenize the chunks; the parent writes each
  chunk as a token shard (`chunk-N.bin`, uint16, or uint32 for vocabularies over 65,536)
  plus its documents' ends (`chunk-N.docs`, int64), each under a temporary name and renamed,
  so a killed run leaves only whole shards and the rerun continues after them;
- `index.json`, written last, names the format, dtype, vocabulary, counts and the cache key
  (the source files' path, size and mtime; the tokenizer file's digest). It is read as
  untrusted data: a malformed index is refused with one paragraph; shards that disagree with
  a well-formed index (truncated, missing) are redone, never read;
- an `fcntl.flock` per shard set makes the first process of a job (of every node sharing the
  filesystem) tokenize while the others wait on the lock, with no collective and so no
  `dist.timeout_s`; then every process memory-maps the shards (`TokenStore`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config.errors import UserError

FORMAT = "cumulus-shards/1"
CHUNK_BYTES = 4 << 20  # source bytes per chunk: bounds memory per worker and per shard
HOME_CACHE = Path("~/.cache/cumulus/shards")
PROGRESS_EVERY_S = 5.0
KINDS = ("jsonl", "json", "parquet", "saved", "text", "files")


@dataclass(frozen=True)
class Source:
    """Documents to tokenize. `kind`: `jsonl` (a record per line), `json` (an array of
    records), `parquet`, `saved` (a `save_to_disk` directory; `split` names a DatasetDict
    split), `text` (one text file, one document, read in pieces) or `files` (text files, one
    document each). `field`: the record field holding the text."""

    kind: str
    paths: tuple[Path, ...]
    field: str = "text"
    split: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(Path(p) for p in self.paths))

    @property
    def name(self) -> str:
        return str(self.paths[0]) if len(self.paths) == 1 else f"{len(self.paths)} files"

    def fingerprint(self) -> list[list[Any]]:
        """Path, size and mtime of every file: cheap (no read), changes with any edit."""
        files: list[Path] = []
        for p in self.paths:
            files += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        out = []
        for f in files:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
        return out


def _tokenizer_identity(tokenizer: Path | None) -> str:
    if tokenizer is None:
        return "bytes"
    return "sha256:" + hashlib.sha256(tokenizer.read_bytes()).hexdigest()


def _cache_key(source: Source, tokenizer: Path | None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "kind": source.kind,
        "field": source.field,
        "split": source.split,
        "files": source.fingerprint(),
        "tokenizer": _tokenizer_identity(tokenizer),
        "chunk_bytes": CHUNK_BYTES,
    }


# --- reading: chunks of documents, cut at the same places every run -------------------------


@dataclass
class Chunk:
    """`payload`: a [start, end) byte range of JSON lines (read and parsed in the worker) or
    texts; `ends[i]`: document i ends
    here (text pieces of one file are documents that end only with the file)."""

    kind: str  # "range" ([start, end) bytes of JSON lines) or "texts"
    payload: list[Any]
    first: int  # 1-based line number of the first record (lines), for messages
    nbytes: int
    ends: list[bool] | None = None


def _missing(path: Path, field: str, where: str, fields: list[str]) -> UserError:
    return UserError(
        f"data.text_field: {where} of {path} has no field {field!r}; its fields: "
        f"{', '.join(map(repr, fields)) or 'none'}. Set data.text_field= to the field that "
        "holds the text."
    )


def _text(value: Any) -> str:
    return "" if value is None else str(value)  # a null text is an empty document


def _chunks_jsonl(path: Path) -> Iterator[Chunk]:
    """Byte ranges of whole lines: workers read and parse them (the parent only finds the
    cut points and counts lines, for messages)."""
    first = 1
    with path.open("rb") as f:
        while True:
            start = f.tell()
            block = f.read(CHUNK_BYTES)
            if not block:
                return
            if not block.endswith(b"\n"):
                block += f.readline()
            yield Chunk("range", [start, start + len(block)], first, len(block))
            first += block.count(b"\n")


def _chunks_texts(texts: Iterator[str]) -> Iterator[Chunk]:
    return _chunks_sized((t, len(t)) for t in texts)


def _chunks_sized(texts: Iterator[tuple[str, int]]) -> Iterator[Chunk]:
    """(text, its size) pairs in chunks of about CHUNK_BYTES."""
    batch: list[str] = []
    size = 0
    for t, n in texts:
        batch.append(t)
        size += n
        if size >= CHUNK_BYTES:
            yield Chunk("texts", batch, 0, size)
            batch, size = [], 0
    if batch:
        yield Chunk("texts", batch, 0, size)


def _json_array(path: Path, field: str) -> Iterator[str]:
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"data.path: {path} is not JSON ({exc})") from None
    for n, record in enumerate(records, 1):
        if not isinstance(record, dict) or field not in record:
            fields = list(record) if isinstance(record, dict) else []
            raise _missing(path, field, f"record {n}", fields)
        yield _text(record[field])


def _parquet_texts(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise _missing(path, field, "the schema", pf.schema_arrow.names)
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        yield from (_text(t) for t in batch.column(0).to_pylist())


def load_saved(path: Path) -> Any:
    """A `save_to_disk` Dataset or DatasetDict (memory-mapped Arrow)."""
    try:
        import datasets
    except ImportError:
        raise UserError(
            "data.path: a save_to_disk directory needs the datasets library; pip install "
            "'cumulus[hf]'"
        ) from None
    try:
        return datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(
            f"data.path: {path} is not a datasets save_to_disk directory ({exc})"
        ) from None


def _saved_texts(path: Path, field: str, split: str | None) -> Iterator[str]:
    ds = load_saved(path)
    if split is not None:
        ds = ds[split]
    if field not in ds.column_names:
        raise _missing(path, field, "the dataset", ds.column_names)
    table = ds.select_columns([field]).with_format("arrow")
    for start in range(0, len(ds), 1024):
        yield from (_text(t) for t in table[start : start + 1024][field].to_pylist())


def _chunks_text_file(path: Path) -> Iterator[Chunk]:
    """One text file as one document, read in pieces. A piece ends with a non-blank line and
    the next starts with a non-space character: byte-level BPE pre-tokenizes there anyway, so
    the pieces' tokens are the whole file's."""
    with path.open("rb") as f:
        while True:
            piece = f.read(CHUNK_BYTES)
            if not piece:
                return
            if len(piece) == CHUNK_BYTES and not piece.endswith(b"\n"):
                piece += f.readline()
            # Cut only between "x\n" and a line starting with a non-space character.
            while f.peek(1)[:1] and (f.peek(1)[:1].isspace() or piece[-2:-1].isspace()):
                piece += f.readline()
            last = not f.peek(1)
            text = piece.decode("utf-8", errors="replace")
            yield Chunk("texts", [text], 0, len(piece), [last])
            if last:
                return


def _chunks_files(paths: tuple[Path, ...]) -> Iterator[Chunk]:
    blobs = (p.read_bytes() for p in paths)  # one file in memory at a time
    return _chunks_sized((b.decode("utf-8", errors="replace"), len(b)) for b in blobs)


def chunks(source: Source) -> Iterator[Chunk]:
    """The source's documents in chunks; the same cut points for the same files."""
    path = source.paths[0]
    if source.kind == "jsonl":
        return _chunks_jsonl(path)
    if source.kind == "json":
        return _chunks_texts(_json_array(path, source.field))
    if source.kind == "parquet":
        return _chunks_texts(_parquet_texts(path, source.field))
    if source.kind == "saved":
        return _chunks_texts(_saved_texts(path, source.field, source.split))
    if source.kind == "text":
        return _chunks_text_file(path)
    if source.kind == "files":
        return _chunks_files(source.paths)
    raise ValueError(f"unknown source kind {source.kind!r}; valid: {', '.join(KINDS)}")


def documents(source: Source) -> Iterator[list[str]]:
    """The source's documents, a chunk (about CHUNK_BYTES of text) at a time, read exactly as
    training reads them: JSON Lines line by line, Parquet by record batches, `save_to_disk`
    through its memory map, each record through `source.field`. Memory is one chunk's, not
    the corpus's (scripts/train_tokenizer.py trains on this)."""
    for chunk in chunks(source):
        yield chunk_texts(chunk, source.paths[0], source.field)


# --- tokenizing: in worker processes ---------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: str | None, path: str, field: str) -> None:
    # Each worker is one core: the Rust library's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.clear()
    _WORKER.update(path=Path(path), field=field, tok=None, eos=None)
    if tokenizer is not None:
        from trainer.data.tokenize import eos_id, load_tokenizer

        tok = load_tokenizer(tokenizer)
        _WORKER.update(tok=tok, eos=eos_id(tok))


def _texts_of(chunk: Chunk) -> list[str]:
    return chunk_texts(chunk, _WORKER["path"], _WORKER["field"])


def chunk_texts(chunk: Chunk, path: Path, field: str) -> list[str]:
    """The documents of one chunk of the source at `path` (records' `field`)."""
    if chunk.kind == "texts":
        return chunk.payload
    start, end = chunk.payload
    with open(path, "rb") as f:
        f.seek(start)
        lines = f.read(end - start).split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    texts = []
    for n, line in enumerate(lines, chunk.first):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"data.path: line {n} of {path} is not JSON ({exc})") from None
        if not isinstance(record, dict) or field not in record:
            fields = list(record) if isinstance(record, dict) else []
            raise _missing(path, field, f"line {n}", fields)
        texts.append(_text(record[field]))
    return texts


def encode(chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int64, documents' lengths) of one chunk; documents end with the tokenizer's
    end-of-text token, if it has one (bytes: no separator)."""
    texts = _texts_of(chunk)
    ends = chunk.ends or [True] * len(texts)
    tok, eos = _WORKER["tok"], _WORKER["eos"]
    if tok is None:
        parts = [np.frombuffer(t.encode("utf-8", errors="replace"), np.uint8) for t in texts]
    else:
        tail = [eos] if eos is not None else []
        parts = [
            np.asarray(e.ids + (tail if end else []), dtype=np.int64)
            for e, end in zip(tok.encode_batch(texts), ends)
        ]
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return tokens, lengths


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# --- writing: shards committed one by one ----------------------------------------------------


def write_shard(chunk: Chunk, i: int, out: Path, dtype: str) -> tuple[int, int, int]:
    """Tokenize chunk i and commit it as shard i (in the worker: only counts travel back).
    Returns (documents, tokens, largest id or -1)."""
    tokens, lengths = encode(chunk)
    biggest = int(tokens.max()) if len(tokens) else -1
    if biggest >= 1 << (8 * np.dtype(dtype).itemsize):
        raise UserError(f"data.tokenizer: token id {biggest} does not fit {dtype}")
    _atomic_write(out / f"chunk-{i:06d}.bin", tokens.astype(dtype))
    _atomic_write(out / f"chunk-{i:06d}.docs", np.cumsum(lengths).astype("<i8"))
    return len(lengths), len(tokens), biggest


def _atomic_write(path: Path, data: bytes | np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        if isinstance(data, np.ndarray):
            data.tofile(f)
        else:
            f.write(data)
    os.replace(tmp, path)


def _committed(out: Path, i: int, itemsize: int) -> tuple[int, int, int] | None:
    """(documents, tokens, max id) of shard i if it is whole, else None."""
    docs, bins = out / f"chunk-{i:06d}.docs", out / f"chunk-{i:06d}.bin"
    try:
        ends = np.fromfile(docs, dtype="<i8")
        size = bins.stat().st_size
    except (OSError, ValueError):
        return None
    if docs.stat().st_size % 8 or (len(ends) and (np.any(np.diff(ends) < 0) or ends[0] < 0)):
        return None
    n_tokens = int(ends[-1]) if len(ends) else 0
    if size != n_tokens * itemsize:
        return None
    return len(ends), n_tokens, -1


class _Progress:
    def __init__(self, source: Source, total_bytes: int, quiet: bool) -> None:
        self.source, self.total, self.quiet = source, total_bytes, quiet
        self.start = self.last = time.monotonic()
        self.docs = self.tokens = self.bytes = 0

    def add(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += nbytes
        now = time.monotonic()
        if not self.quiet and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        dt = max(now - self.start, 1e-9)
        rate = self.bytes / dt
        eta = (self.total - self.bytes) / rate if rate > 0 and self.total else 0.0
        pct = 100.0 * self.bytes / self.total if self.total else 100.0
        return (
            f"tokenizing {self.source.name}: {pct:5.1f}% | {self.docs:,} documents "
            f"({self.docs / dt:,.0f}/s) | {self.bytes / 1e6:,.1f} MB ({rate / 1e6:.1f} MB/s) | "
            f"{self.tokens:,} tokens | ETA {eta:.0f} s"
        )


def _prepare(out: Path, tokenizer: Path | None) -> tuple[int, np.dtype]:
    """The shard folder, cleared of half-written files, its build logged; the vocabulary size
    and the token dtype that holds it."""
    out.mkdir(parents=True, exist_ok=True)
    for tmp in out.glob(".*.tmp"):  # half-written by a killed run: never committed
        with contextlib.suppress(OSError):
            tmp.unlink()
    # Who tokenized this, one line per build (a resumed build adds a line): for operators,
    # and for tests that check a job tokenizes once.
    with open(out / "builds.log", "a") as log:
        log.write(
            f"{time.time():.3f} {os.uname().nodename} pid={os.getpid()} "
            f"rank={os.environ.get('RANK', '0')}\n"
        )
    vocab = 256
    if tokenizer is not None:
        from trainer.data.tokenize import load_tokenizer

        vocab = load_tokenizer(tokenizer).get_vocab_size()
    return vocab, np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


def _pool(workers: int, tokenizer: Path | None, source: Source) -> ProcessPoolExecutor | None:
    """Tokenizer worker processes (None: tokenize in this process, set up here)."""
    init = (None if tokenizer is None else str(tokenizer), str(source.paths[0]), source.field)
    if workers == 1:
        _init_worker(*init)
        return None
    # fork: workers start in milliseconds and import nothing again.
    return ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("fork"),
        initializer=_init_worker,
        initargs=init,
    )


def build(
    source: Source,
    tokenizer: Path | None,
    out: Path,
    key: dict[str, Any],
    workers: int,
    quiet: bool = False,
) -> None:
    """Tokenize `source` into shards under `out` (the caller holds the lock). Shards already
    committed by an interrupted run are kept, not redone."""
    vocab, dtype = _prepare(out, tokenizer)
    total = sum(size for _, size, _ in key["files"])
    progress = _Progress(source, total, quiet)
    counts: list[list[int]] = []  # per shard: documents, tokens
    biggest = -1

    def commit(i: int, n_docs: int, n_tokens: int, max_id: int) -> None:
        nonlocal biggest
        biggest = max(biggest, max_id)
        counts.append([n_docs, n_tokens])

    pending: deque[tuple[int, Chunk, Any]] = deque()
    workers = max(1, workers)
    pool = _pool(workers, tokenizer, source)

    def drain(limit: int) -> None:
        while len(pending) > limit:
            i, chunk, fut = pending.popleft()
            try:
                n_docs, n_tokens, max_id = fut.result()
            except BrokenProcessPool:
                raise UserError(
                    f"data.path: a tokenizer worker process died while tokenizing chunk {i} of "
                    f"{source.name} (killed, or out of memory: try fewer data.tokenize_workers="
                    f"than {workers}). Shards committed so far are kept; rerunning continues "
                    "from them."
                ) from None
            except UserError as exc:  # raised in a worker: drop the remote traceback
                raise UserError(str(exc)) from None
            commit(i, n_docs, n_tokens, max_id)
            progress.add(n_docs, n_tokens, chunk.nbytes)

    try:
        for i, chunk in enumerate(chunks(source)):
            done = _committed(out, i, dtype.itemsize)
            if done is not None:  # committed by an interrupted run
                drain(0)
                tokens = np.memmap(out / f"chunk-{i:06d}.bin", dtype, "r") if done[1] else None
                if tokens is not None:
                    biggest = max(biggest, int(tokens.max()))
                counts.append([done[0], done[1]])
                progress.add(done[0], done[1], chunk.nbytes)
                continue
            if pool is None:
                commit(i, *write_shard(chunk, i, out, dtype.str))
                progress.add(*counts[-1], chunk.nbytes)
                continue
            pending.append((i, chunk, pool.submit(write_shard, chunk, i, out, dtype.str)))
            drain(2 * workers)  # memory: at most 2 chunks per worker in flight
        drain(0)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    index = {
        "format": FORMAT,
        "dtype": dtype.str,
        "vocab_size": vocab,
        "max_id": biggest,
        "documents": sum(c[0] for c in counts),
        "tokens": sum(c[1] for c in counts),
        "shards": counts,
        "key": key,
    }
    _atomic_write(out / "index.json", json.dumps(index, indent=1).encode())
    if not quiet:
        print(progress.line(time.monotonic()) + " | done", file=sys.stderr, flush=True)


# --- reading the shards back ------------------------------------------------------------------


def _refuse(path: Path, why: str) -> UserError:
    return UserError(
        f"data.cache_dir: {path} is not a shard index cumulus wrote ({why}). Delete its "
        f"directory {path.parent} (it is only a cache: the corpus is tokenized again), or "
        "point data.cache_dir= elsewhere."
    )


def read_index(path: Path) -> dict[str, Any]:
    """`index.json` checked as untrusted data: names, types and ranges; nothing in it picks
    code or a path outside its directory."""
    try:
        raw = path.read_bytes()
        if len(raw) > 64 << 20:
            raise _refuse(path, f"{len(raw)} bytes")
        index = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(path, f"not JSON: {exc}") from None
    if not isinstance(index, dict):
        raise _refuse(path, "not a JSON object")
    if index.get("format") != FORMAT:
        raise _refuse(path, f"format {index.get('format')!r}, expected {FORMAT!r}")
    if index.get("dtype") not in ("<u2", "<u4"):
        raise _refuse(path, f"dtype {index.get('dtype')!r}, expected '<u2' or '<u4'")
    for name in ("vocab_size", "max_id", "documents", "tokens"):
        v = index.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < (-1 if name == "max_id" else 0):
            raise _refuse(path, f"{name} {v!r} is not a count")
    if index["max_id"] >= 1 << (8 * np.dtype(index["dtype"]).itemsize):
        raise _refuse(path, f"max_id {index['max_id']} does not fit {index['dtype']}")
    shards = index.get("shards")
    if not isinstance(shards, list) or not all(
        isinstance(s, list)
        and len(s) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s)
        for s in shards
    ):
        raise _refuse(path, "shards is not a list of [documents, tokens] counts")
    if (
        sum(s[0] for s in shards) != index["documents"]
        or sum(s[1] for s in shards) != index["tokens"]
    ):
        raise _refuse(path, "the shards' counts do not add up to documents and tokens")
    if not isinstance(index.get("key"), dict):
        raise _refuse(path, "no cache key")
    return index


class TokenStore:
    """The shards of one corpus, memory-mapped: `read(a, b)` gives tokens a..b-1 of the
    concatenated documents; `doc_offsets` (documents + 1,) their boundaries."""

    def __init__(self, root: Path, index: dict[str, Any]) -> None:
        self.root = root
        self.reused = False  # found already tokenized (a cache hit), not built by this run
        self.dtype = np.dtype(index["dtype"])
        self.vocab_size = int(index["vocab_size"])
        self.max_id = int(index["max_id"])
        counts = np.array([s[1] for s in index["shards"]], dtype=np.int64).reshape(-1)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        ends = []
        for i, (n_docs, n_tokens) in enumerate(index["shards"]):
            e = np.fromfile(root / f"chunk-{i:06d}.docs", dtype="<i8")
            if len(e) != n_docs or (n_docs and int(e[-1]) != n_tokens):
                raise _Damaged(f"shard {i} documents")
            if (root / f"chunk-{i:06d}.bin").stat().st_size != n_tokens * self.dtype.itemsize:
                raise _Damaged(f"shard {i} size")
            ends.append(e + self.starts[i])
        self.doc_offsets = np.concatenate([[0], *ends]).astype(np.int64)
        if np.any(np.diff(self.doc_offsets) < 0):
            raise _Damaged("document offsets")
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the maps
        return {**self.__dict__, "_maps": None}

    def _open(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [
                np.memmap(self.root / f"chunk-{i:06d}.bin", self.dtype, "r")
                if self.starts[i + 1] > self.starts[i]
                else np.zeros(0, self.dtype)
                for i in range(len(self.starts) - 1)
            ]
        return self._maps

    def read(self, a: int, b: int) -> np.ndarray:
        maps, parts = self._open(), []
        i = int(np.searchsorted(self.starts, a, side="right")) - 1
        while a < b and i < len(maps):
            lo, hi = int(self.starts[i]), int(self.starts[i + 1])
            if hi > a:
                parts.append(maps[i][a - lo : min(b, hi) - lo])
                a = min(b, hi)
            i += 1
        return np.concatenate(parts) if len(parts) != 1 else np.asarray(parts[0])


class _Damaged(Exception):
    pass


def cache_root(source: Source, cache_dir: str | Path | None) -> Path:
    """`cache_dir`, else `.cumulus-cache/` next to the data when writable, else
    `~/.cache/cumulus/shards`."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    first = source.paths[0]
    beside = (first if first.is_dir() else first.parent) / ".cumulus-cache"
    with contextlib.suppress(OSError):
        beside.mkdir(exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    return HOME_CACHE.expanduser()


def shard_dir(source: Source, tokenizer: Path | None, cache_dir: str | Path | None) -> Path:
    key = _cache_key(source, tokenizer)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    stem = source.paths[0].name.replace(".", "_") + (f"-{source.split}" if source.split else "")
    return cache_root(source, cache_dir) / f"{stem}-{digest}"


def _try_load(out: Path, key: dict[str, Any]) -> TokenStore | None:
    path = out / "index.json"
    if not path.is_file():
        return None
    index = read_index(path)
    if index["key"] != json.loads(json.dumps(key)):
        raise _refuse(path, "its cache key does not match the directory it is in")
    try:
        return TokenStore(out, index)
    except (_Damaged, OSError, ValueError):
        return None


def open_shards(
    source: Source,
    tokenizer: str | Path | None,
    cache_dir: str | Path | None = None,
    workers: int | None = None,
    quiet: bool | None = None,
) -> TokenStore:
    """The source's tokens: built once (the first process to take the lock tokenizes, the
    others wait for it), then memory-mapped."""
    from trainer.data.tokenize import tokenizer_file

    file = tokenizer_file(tokenizer) if tokenizer else None
    for p in source.paths:
        if not p.exists():
            raise UserError(f"data.path: {p} does not exist")
    key = _cache_key(source, file)
    out = shard_dir(source, file, cache_dir)
    store = _try_load(out, key)  # cached start: no lock, no read of the corpus
    if store is not None:
        store.reused = True
        return store
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        time.sleep(0.5)  # let rank 0 take the lock: it shows the progress lines
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.parent / f".{out.name}.lock", "a+")  # noqa: SIM115
    except OSError as exc:
        raise UserError(
            f"data.cache_dir: cannot write token shards under {out.parent} ({exc.strerror}); "
            "set data.cache_dir= to a writable directory"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits as long as the tokenizing process needs
        store = _try_load(out, key)
        if store is None:  # first here, or damaged: (re)build, keeping whole shards
            with contextlib.suppress(FileNotFoundError):
                (out / "index.json").unlink()
            n = default_workers() if workers is None else workers
            build(source, file, out, key, n, quiet=rank != 0 if quiet is None else quiet)
            store = _try_load(out, key)
            if store is None:
                raise UserError(f"data.cache_dir: shards just written under {out} do not read back")
    return store


# --- views: documents selected from a store, as one token stream -----------------------------


class TokenView:
    """Selected documents of a store as one token stream (e.g. all but every n-th document):
    `read(a, b)` maps stream positions onto the store's runs of selected documents."""

    def __init__(self, store: TokenStore, selected: np.ndarray | None = None) -> None:
        self.store = store
        offsets = store.doc_offsets
        if selected is None:
            selected = np.ones(len(offsets) - 1, dtype=bool)
        self.doc_lengths = np.diff(offsets)[selected]
        # Runs of consecutive selected documents are one segment each.
        edges = np.diff(np.concatenate([[0], selected.astype(np.int8), [0]]))
        first, stop = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        self.seg_start = offsets[first]
        seg_len = offsets[stop] - offsets[first]
        self.seg_virtual = np.concatenate([[0], np.cumsum(seg_len)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.seg_virtual[-1])

    def read(self, a: int, b: int) -> np.ndarray:
        parts = []
        i = int(np.searchsorted(self.seg_virtual, a, side="right")) - 1
        while a < b and i < len(self.seg_start):
            lo, hi = int(self.seg_virtual[i]), int(self.seg_virtual[i + 1])
            if hi > a:
                end = min(b, hi)
                s = int(self.seg_start[i])
                parts.append(self.store.read(s + a - lo, s + end - lo))
                a = end
            i += 1
        if not parts:
            return np.zeros(0, self.store.dtype)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def offsets(self) -> np.ndarray:
        """Document boundaries in stream positions."""
        return np.concatenate([[0], np.cumsum(self.doc_lengths)]).astype(np.int64)
