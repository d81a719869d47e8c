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
import dataclasses
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
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
from trainer.data.encoding import BadRecord, Encoded, Encoder, TextEncoder
from trainer.tracking.plurals import counted

FORMAT = "cumulus-shards/1"
CHUNK_BYTES = 4 << 20  # source bytes per chunk: bounds memory per worker and per shard
HOME_CACHE = Path("~/.cache/cumulus/shards")
PROGRESS_EVERY_S = 5.0
KINDS = ("jsonl", "json", "parquet", "saved", "text", "files")
EXTRA_DTYPES = ("|u1", "<i4", "<i8")  # what an encoder's extra arrays may be stored as


@dataclass(frozen=True)
class Source:
    """Documents to tokenize. `kind`: `jsonl` (a record per line), `json` (an array of
    records), `parquet`, `saved` (a `save_to_disk` directory; `split` names a DatasetDict
    split), `text` (one text file, one document, read in pieces) or `files` (text files, one
    document each). `field`: the record field holding the text; or `columns`: each record is
    the dict of those of its fields it has (an encoder of structured rows, such as data=chat's
    conversations, reads them)."""

    kind: str
    paths: tuple[Path, ...]
    field: str = "text"
    split: str | None = None
    columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(Path(p) for p in self.paths))
        object.__setattr__(self, "columns", tuple(self.columns))

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


def _cache_key(source: Source, encoder: Encoder) -> dict[str, Any]:
    key = {
        "format": FORMAT,
        "kind": source.kind,
        "field": source.field,
        "split": source.split,
        "files": source.fingerprint(),
        "tokenizer": encoder.identity(),
        "chunk_bytes": CHUNK_BYTES,
    }
    if source.columns:
        key["columns"] = list(source.columns)
    return key


# --- reading: chunks of documents, cut at the same places every run -------------------------


@dataclass
class Chunk:
    """`payload`: a [start, end) byte range of JSON lines (read and parsed in the worker) or
    values (texts, or records of `Source.columns`); `ends[i]`: document i ends here (text
    pieces of one file are documents that end only with the file)."""

    kind: str  # "range" ([start, end) bytes of JSON lines) or "texts"
    payload: list[Any]
    # 1-based line number of the first record (lines), or number of the first value: messages
    first: int
    nbytes: int
    ends: list[bool] | None = None


def _missing(where: str, field: str, fields: list[str]) -> UserError:
    return BadRecord(
        f"data.text_field: {where} has no field {field!r} (its fields: "
        f"{', '.join(map(repr, fields)) or 'none'}).",
        "Set data.text_field= to the field that holds the text.",
    )


def _not_text(field: str, where: str, value: Any) -> BadRecord:
    kind = type(value).__name__
    return BadRecord(
        f"data.text_field: {where} holds a {kind} in field {field!r} ({repr(value)[:60]}), not "
        "text;",
        f"data=hf trains on one text field per record and would read the Python text of the "
        f"{kind}. Conversations (a list of role/content messages) are data=chat "
        "(data=chat data.path=...); otherwise set data.text_field= to a field holding text.",
    )


def _text(value: Any, field: str = "text", where: str = "a record") -> str:
    if value is None:
        return ""  # a null text is an empty document
    if not isinstance(value, str):
        raise _not_text(field, where, value)
    return value


def _value(record: Any, source: Source, path: Path, where: str) -> Any:
    """What a record gives its encoder: the text of `source.field`, or with `source.columns`
    the record itself (Parquet and save_to_disk read only those columns)."""
    if source.columns:
        if not isinstance(record, dict):
            raise BadRecord(
                f"data.path: {where} is a JSON {type(record).__name__}, not an object with "
                f"fields {', '.join(source.columns)}"
            )
        return record
    if not isinstance(record, dict) or source.field not in record:
        fields = list(record) if isinstance(record, dict) else []
        raise _missing(where, source.field, fields)
    return _text(record[source.field], source.field, where)


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


def _size(value: Any) -> int:
    """About how many bytes of text a value holds (texts, records of strings)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_size(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_size(v) for v in value)
    return 8


def _chunks_texts(values: Iterator[Any]) -> Iterator[Chunk]:
    return _chunks_sized((v, _size(v)) for v in values)


def _chunks_sized(texts: Iterator[tuple[Any, int]]) -> Iterator[Chunk]:
    """(value, its size) pairs in chunks of about CHUNK_BYTES."""
    batch: list[Any] = []
    size, first = 0, 1
    for t, n in texts:
        batch.append(t)
        size += n
        if size >= CHUNK_BYTES:
            yield Chunk("texts", batch, first, size)
            first += len(batch)
            batch, size = [], 0
    if batch:
        yield Chunk("texts", batch, first, size)


def _json_array(path: Path, source: Source) -> Iterator[Any]:
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise BadRecord(f"data.path: {path} is not JSON ({exc})") from None
    if not isinstance(records, list):
        raise BadRecord(f"data.path: {path} holds a JSON {type(records).__name__}, not an array")
    for n, record in enumerate(records, 1):
        yield _value(record, source, path, f"{path}: row {n}")


def _parquet_values(path: Path, source: Source) -> Iterator[Any]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if source.columns:
        columns = [c for c in source.columns if c in names]
        yield from _column_records(
            (b.to_pylist() for b in pf.iter_batches(batch_size=1024, columns=columns)),
        )
        return
    field = source.field
    if field not in names:
        raise _missing(f"the schema of {path}", field, names)
    _check_text_column(pf.schema_arrow.field(field).type, field, path)
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        yield from (_text(t, field) for t in batch.column(0).to_pylist())


def _column_records(batches: Iterator[list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    for rows in batches:
        yield from rows


def _check_text_column(kind: Any, field: str, path: Path) -> None:
    """A column that is not text (a list of messages, numbers) is refused before any read."""
    import pyarrow as pa

    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        example = [{"role": "user", "content": "..."}] if pa.types.is_list(kind) else kind
        raise _not_text(field, f"column {field!r} of {path} (type {kind})", example)


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


def _saved_values(path: Path, source: Source) -> Iterator[Any]:
    ds = load_saved(path)
    if source.split is not None:
        ds = ds[source.split]
    if source.columns:
        columns = [c for c in source.columns if c in ds.column_names]
        table = ds.select_columns(columns).with_format("arrow")
        for start in range(0, len(ds), 1024):
            yield from table[start : start + 1024].to_pylist()
        return
    field = source.field
    if field not in ds.column_names:
        raise _missing(f"the dataset of {path}", field, ds.column_names)
    table = ds.select_columns([field]).with_format("arrow")
    _check_text_column(table.features.arrow_schema.field(field).type, field, path)
    for start in range(0, len(ds), 1024):
        yield from (_text(t, field) for t in table[start : start + 1024][field].to_pylist())


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
        return _chunks_texts(_json_array(path, source))
    if source.kind == "parquet":
        return _chunks_texts(_parquet_values(path, source))
    if source.kind == "saved":
        return _chunks_texts(_saved_values(path, source))
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


def _init_worker(encoder: Encoder, path: str, source: Source) -> None:
    # Each worker is one core: the Rust library's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.clear()
    _WORKER.update(path=Path(path), source=source, encoder=encoder)
    encoder.start()


def chunk_texts(chunk: Chunk, path: Path, field: str) -> list[str]:
    """The documents of one chunk of the source at `path` (records' `field`)."""
    return chunk_values(chunk, path, Source("jsonl", (path,), field))[0]


def _where(chunk: Chunk, path: Path, i: int) -> str:
    if chunk.kind == "range":
        return f"{path}:{i}"
    return f"{path}: row {i}" if chunk.first else str(path)


def chunk_values(chunk: Chunk, path: Path, source: Source) -> tuple[list[Any], list[str]]:
    """What the records of one chunk give the encoder (`_value`), and where each is: `FILE:LINE`
    for JSON Lines, `FILE: row N` otherwise. Every bad record of the chunk is one `BadRows`."""
    values, wheres, bad = _read_chunk(chunk, path, source)
    if bad:
        raise BadRows.of(bad, path)
    return values, wheres


def _read_chunk(
    chunk: Chunk, path: Path, source: Source
) -> tuple[list[Any], list[str], list[tuple[int, BadRecord]]]:
    """The chunk's good records (values, where each is) and its bad ones (line, refusal)."""
    if chunk.kind == "texts":
        where = [_where(chunk, path, chunk.first + i) for i in range(len(chunk.payload))]
        return chunk.payload, where, []
    start, end = chunk.payload
    with open(path, "rb") as f:
        f.seek(start)
        lines = f.read(end - start).split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    values, wheres, bad = [], [], []
    for n, line in enumerate(lines, chunk.first):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            values.append(_value(_json(line, where), source, path, where))
        except BadRecord as exc:
            if not exc.of_row:
                raise
            bad.append((n, exc))
            continue
        wheres.append(where)
    return values, wheres, bad


def _json(line: bytes, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadRecord(f"data.path: {where} is not JSON ({exc})") from None


def encode(chunk: Chunk) -> Encoded:
    """One chunk's documents through the worker's encoder. A bad record does not stop the
    reading: every bad record of the chunk is one `BadRows` (the encoder's refusals found by
    encoding the records one by one, once it refused the chunk)."""
    path, encoder = _WORKER["path"], _WORKER["encoder"]
    values, where, bad = _read_chunk(chunk, path, _WORKER["source"])
    if not bad:
        try:
            return encoder.encode(values, where, chunk.ends)
        except BadRecord as exc:
            if not exc.of_row:
                raise
    ends = chunk.ends or [True] * len(values)
    for i, (value, at) in enumerate(zip(values, where)):
        try:
            encoder.encode([value], [at], [ends[i]])
        except BadRecord as exc:
            if not exc.of_row:
                raise
            bad.append((_number(at, chunk.first + i), exc))
    raise BadRows.of(bad, path)


def _unkeyed(message: str) -> str:
    key, _, rest = message.partition(": ")
    return rest if key.startswith("data.") and rest else message


def _number(where: str, fallback: int) -> int:
    """The line number of a `FILE:LINE` place (else `fallback`): bad rows sort by it."""
    tail = where.rpartition(":")[2]
    return int(tail) if tail.isdigit() else fallback


@dataclass
class BadTally:
    """The bad records of one file, in file order: the first `BadRows.NAMED` kept as (line,
    message, hint), every one counted, each distinct hint once."""

    rows: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    count: int = 0
    hints: list[str] = dataclasses.field(default_factory=list)

    def add(self, line: int, message: str, hint: str) -> None:
        self.count += 1
        if len(self.rows) < BadRows.NAMED:
            self.rows.append((line, message, hint))
        if hint and hint not in self.hints:
            self.hints.append(hint)

    def merge(self, other: BadTally) -> None:
        for row in other.rows:
            self.add(*row)
        self.count += other.count - len(other.rows)
        self.hints += [h for h in other.hints if h not in self.hints]


class BadRows(BadRecord):
    """Every bad record of one file in one paragraph, in file order: the first `NAMED` named
    (`FILE:LINE` and what is wrong), the rest counted, each distinct hint said once. Reading
    stops after `STOP` bad records (a wrong field name in a large corpus)."""

    NAMED = 10
    STOP = 1000

    def __init__(self, message: str, hint: str = "", tally: BadTally | None = None) -> None:
        super().__init__(message, hint)
        self.tally = tally or BadTally()

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.message, self.hint, self.tally)

    @classmethod
    def of(cls, bad: list[tuple[int, BadRecord]], path: Path | str) -> BadRows:
        tally = BadTally()
        for n, exc in sorted(bad, key=lambda b: b[0]):
            tally.add(n, exc.message, exc.hint)
        return cls.joined(tally, path)

    @classmethod
    def joined(cls, tally: BadTally, path: Path | str, stopped: bool = False) -> BadRows:
        if tally.count == 1:
            ((_, message, hint),) = tally.rows
            return cls(message, hint, tally)
        key = tally.rows[0][1].partition(": ")[0]
        # Each row's message without its key (`data.path: `): the paragraph names it once.
        named = "; ".join(_unkeyed(m).rstrip(".") for _, m, _ in tally.rows)
        more = tally.count - len(tally.rows)
        rest = f"; and {counted(more, 'more bad row')}" if more > 0 else ""
        if stopped:
            rest += f" (reading stopped there: {cls.STOP} bad rows are enough to say)"
        rows = f"{tally.count} or more rows" if stopped else counted(tally.count, "row")
        return cls(
            f"{key}: {rows} of {path} cannot be used (fix or remove them): {named}{rest}.",
            " ".join(tally.hints),
            tally,
        )


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# --- writing: shards committed one by one ----------------------------------------------------


def write_shard(chunk: Chunk, i: int, out: Path, dtype: str) -> tuple[int, int, int]:
    """Tokenize chunk i and commit it as shard i (in the worker: only counts travel back).
    Returns (documents, tokens, largest id or -1)."""
    encoded = encode(chunk)
    tokens, lengths = encoded.tokens, encoded.lengths
    biggest = int(tokens.max()) if len(tokens) else -1
    if biggest >= 1 << (8 * np.dtype(dtype).itemsize):
        raise UserError(f"data.tokenizer: token id {biggest} does not fit {dtype}")
    _atomic_write(out / f"chunk-{i:06d}.bin", tokens.astype(dtype))
    for name, (per, kind) in _WORKER["encoder"].extras.items():
        values = np.asarray(encoded.extras[name])
        want = len(tokens) if per == "token" else len(lengths)
        if len(values) != want:
            raise RuntimeError(f"encoder extra {name!r}: {len(values)} values, expected {want}")
        _atomic_write(out / f"chunk-{i:06d}.{name}", values.astype(kind))
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


def _committed(
    out: Path, i: int, itemsize: int, extras: dict[str, tuple[str, str]] | None = None
) -> tuple[int, int, int] | None:
    """(documents, tokens, max id) of shard i if it is whole (its extras too), else None."""
    docs, bins = out / f"chunk-{i:06d}.docs", out / f"chunk-{i:06d}.bin"
    try:
        ends = np.fromfile(docs, dtype="<i8")
        size = bins.stat().st_size
        sizes = {n: (out / f"chunk-{i:06d}.{n}").stat().st_size for n in extras or {}}
    except (OSError, ValueError):
        return None
    if docs.stat().st_size % 8 or (len(ends) and (np.any(np.diff(ends) < 0) or ends[0] < 0)):
        return None
    n_tokens = int(ends[-1]) if len(ends) else 0
    if size != n_tokens * itemsize:
        return None
    for name, (per, kind) in (extras or {}).items():
        if sizes[name] != (n_tokens if per == "token" else len(ends)) * np.dtype(kind).itemsize:
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


def _prepare(out: Path, encoder: Encoder) -> tuple[int, np.dtype]:
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
    vocab = encoder.vocab_size()
    return vocab, np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


def _pool(workers: int, encoder: Encoder, source: Source) -> ProcessPoolExecutor | None:
    """Tokenizer worker processes (None: tokenize in this process, set up here)."""
    init = (encoder, str(source.paths[0]), source)
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
    encoder: Encoder,
    out: Path,
    key: dict[str, Any],
    workers: int,
    quiet: bool = False,
) -> None:
    """Tokenize `source` into shards under `out` (the caller holds the lock). Shards already
    committed by an interrupted run are kept, not redone."""
    vocab, dtype = _prepare(out, encoder)
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
    pool = _pool(workers, encoder, source)
    bad = BadTally()  # every bad record of the source: read on, then refuse
    stopped = False

    def drain(limit: int) -> None:
        while len(pending) > limit:
            i, chunk, fut = pending.popleft()
            try:
                n_docs, n_tokens, max_id = fut.result()
            except BrokenProcessPool:
                raise worker_died(i, source.name, workers) from None
            except BadRows as exc:
                bad.merge(exc.tally)
                continue
            except UserError as exc:  # raised in a worker: drop the remote traceback
                raise type(exc)(str(exc)) from None
            commit(i, n_docs, n_tokens, max_id)
            progress.add(n_docs, n_tokens, chunk.nbytes)

    try:
        for i, chunk in enumerate(chunks(source)):
            if bad.count >= BadRows.STOP:
                stopped = True
                break
            done = _committed(out, i, dtype.itemsize, encoder.extras)
            if done is not None:  # committed by an interrupted run
                drain(0)
                tokens = np.memmap(out / f"chunk-{i:06d}.bin", dtype, "r") if done[1] else None
                if tokens is not None:
                    biggest = max(biggest, int(tokens.max()))
                counts.append([done[0], done[1]])
                progress.add(done[0], done[1], chunk.nbytes)
                continue
            if pool is None:
                try:
                    commit(i, *write_shard(chunk, i, out, dtype.str))
                except BadRows as exc:
                    bad.merge(exc.tally)
                    continue
                progress.add(*counts[-1], chunk.nbytes)
                continue
            pending.append((i, chunk, pool.submit(write_shard, chunk, i, out, dtype.str)))
            drain(2 * workers)  # memory: at most 2 chunks per worker in flight
        drain(0)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    if bad.count:
        raise BadRows.joined(bad, source.name, stopped)
    write_index(out, dtype, vocab, biggest, counts, encoder.extras, key)
    if not quiet:
        print(progress.line(time.monotonic()) + " | done", file=sys.stderr, flush=True)


def worker_died(chunk: int, source: str, workers: int) -> UserError:
    """A tokenizer worker process died (killed, out of memory): one paragraph."""
    return UserError(
        f"data.path: a tokenizer worker process died while tokenizing chunk {chunk} of "
        f"{source} (killed, or out of memory: try fewer data.tokenize_workers= than "
        f"{workers}). Shards committed so far are kept; rerunning continues from them."
    )


def write_index(
    out: Path,
    dtype: np.dtype,
    vocab: int,
    biggest: int,
    counts: list[list[int]],
    extras: dict[str, Any],
    key: dict[str, Any],
) -> None:
    """The shards' index, written whole (atomically) once every shard is committed: the
    cache is complete when it exists."""
    index = {
        "format": FORMAT,
        "dtype": dtype.str,
        "vocab_size": vocab,
        "max_id": biggest,
        "documents": sum(c[0] for c in counts),
        "tokens": sum(c[1] for c in counts),
        "shards": counts,
        "extras": {name: list(spec) for name, spec in extras.items()},
        "key": key,
    }
    _atomic_write(out / "index.json", json.dumps(index, indent=1).encode())


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
    extras = index.setdefault("extras", {})
    if not isinstance(extras, dict) or not all(
        isinstance(name, str)
        and name.isidentifier()
        and isinstance(spec, list)
        and len(spec) == 2
        and spec[0] in ("token", "doc")
        and spec[1] in EXTRA_DTYPES
        for name, spec in extras.items()
    ):
        raise _refuse(path, "extras is not a mapping of name to [token|doc, dtype]")
    return index


class TokenStore:
    """The shards of one corpus, memory-mapped: `read(a, b)` gives tokens a..b-1 of the
    concatenated documents; `doc_offsets` (documents + 1,) their boundaries. An encoder's
    extras: `read_extra(name, a, b)` (per token), `doc_extra(name)` (per document)."""

    def __init__(self, root: Path, index: dict[str, Any]) -> None:
        self.root = root
        self.reused = False  # found already tokenized (a cache hit), not built by this run
        self.dtype = np.dtype(index["dtype"])
        self.vocab_size = int(index["vocab_size"])
        self.max_id = int(index["max_id"])
        self.extras = {name: (per, np.dtype(kind)) for name, (per, kind) in index["extras"].items()}
        counts = np.array([s[1] for s in index["shards"]], dtype=np.int64).reshape(-1)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.n_docs = [int(s[0]) for s in index["shards"]]
        ends = []
        for i, (n_docs, n_tokens) in enumerate(index["shards"]):
            e = np.fromfile(root / f"chunk-{i:06d}.docs", dtype="<i8")
            if len(e) != n_docs or (n_docs and int(e[-1]) != n_tokens):
                raise _Damaged(f"shard {i} documents")
            if (root / f"chunk-{i:06d}.bin").stat().st_size != n_tokens * self.dtype.itemsize:
                raise _Damaged(f"shard {i} size")
            for name, (per, kind) in self.extras.items():
                size = (root / f"chunk-{i:06d}.{name}").stat().st_size
                if size != (n_tokens if per == "token" else n_docs) * kind.itemsize:
                    raise _Damaged(f"shard {i} {name}")
            ends.append(e + self.starts[i])
        self.doc_offsets = np.concatenate([[0], *ends]).astype(np.int64)
        if np.any(np.diff(self.doc_offsets) < 0):
            raise _Damaged("document offsets")
        self._maps: dict[str, list[np.ndarray]] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the maps
        return {**self.__dict__, "_maps": {}}

    def _open(self, suffix: str = "bin") -> list[np.ndarray]:
        if suffix not in self._maps:
            dtype = self.dtype if suffix == "bin" else self.extras[suffix][1]
            self._maps[suffix] = [
                np.memmap(self.root / f"chunk-{i:06d}.{suffix}", dtype, "r")
                if self.starts[i + 1] > self.starts[i]
                else np.zeros(0, dtype)
                for i in range(len(self.starts) - 1)
            ]
        return self._maps[suffix]

    def read(self, a: int, b: int, suffix: str = "bin") -> np.ndarray:
        maps, parts = self._open(suffix), []
        i = int(np.searchsorted(self.starts, a, side="right")) - 1
        while a < b and i < len(maps):
            lo, hi = int(self.starts[i]), int(self.starts[i + 1])
            if hi > a:
                parts.append(maps[i][a - lo : min(b, hi) - lo])
                a = min(b, hi)
            i += 1
        if not parts:
            return np.zeros(0, maps[0].dtype if maps else self.dtype)
        return np.concatenate(parts) if len(parts) != 1 else np.asarray(parts[0])

    def read_extra(self, name: str, a: int, b: int) -> np.ndarray:
        """Values a..b-1 of the per-token extra `name`."""
        if self.extras.get(name, ("",))[0] != "token":
            raise KeyError(f"{self.root} has no per-token array {name!r}")
        return self.read(a, b, name)

    def doc_extra(self, name: str) -> np.ndarray:
        """The per-document extra `name` of every document (in memory: one value each)."""
        if self.extras.get(name, ("",))[0] != "doc":
            raise KeyError(f"{self.root} has no per-document array {name!r}")
        kind = self.extras[name][1]
        parts = [
            np.fromfile(self.root / f"chunk-{i:06d}.{name}", dtype=kind)
            for i in range(len(self.n_docs))
        ]
        return np.concatenate(parts) if parts else np.zeros(0, kind)


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


def shard_dir(source: Source, encoder: Encoder, cache_dir: str | Path | None) -> Path:
    key = _cache_key(source, encoder)
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
    encoder: Encoder | None = None,
) -> TokenStore:
    """The source's tokens: built once (the first process to take the lock tokenizes, the
    others wait for it), then memory-mapped. `encoder`: how records become tokens (default:
    text through `tokenizer`, or bytes)."""
    from trainer.data.tokenize import tokenizer_file

    if encoder is None:
        encoder = TextEncoder(tokenizer_file(tokenizer) if tokenizer else None)
    for p in source.paths:
        if not p.exists():
            raise UserError(f"data.path: {p} does not exist")
    key = _cache_key(source, encoder)
    out = shard_dir(source, encoder, cache_dir)
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
            try:
                build(source, encoder, out, key, n, quiet=rank != 0 if quiet is None else quiet)
            except BadRecord:
                # These files can never be completed (the key names them as they are): no
                # shard of them is left behind.
                shutil.rmtree(out, ignore_errors=True)
                raise
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
