"""Corpus-scale data: cumulus's tokenize-to-shards pipeline against a plain streaming loop.

    python scripts/bench_corpus.py [--mb 300] [--vocab 8192] [--out DIR] [--report FILE]

Makes a corpus of `--mb` MB as JSON Lines and as Parquet (stdlib sources, each document
tagged with its number), trains a BPE tokenizer (scripts/train_tokenizer.py), then measures,
each in a fresh process, wall time, CPU time (user+sys, the process and its children) and the
peak RSS of the largest process:

- `loop`: the plain streaming loop of issue 20 (records read line by line, `encode_batch` on
  512 documents at a time, ids appended to a uint16 file);
- `cumulus jsonl` / `cumulus parquet`: `python -m trainer.train data=hf ... train.max_steps=1`
  from an empty cache (time to the first training step, tokenizing included);
- `cumulus cached`: the same run again (the shards are memory-mapped, nothing re-read), and a
  bare `hf_data(...)` call on the cached corpus (what a cached start adds);
- `2 ranks`: `torchrun --nproc_per_node=2` from an empty cache: the job tokenizes once;
- with `--baseline-tree DIR` (an older checkout: `git archive REV | tar -x -C DIR`; may be
  given several times), the same 1-rank run on that tree's code, e.g. the in-memory `data=hf`
  before the shards.

With `--rounds N` the loop, the 1-rank JSONL run and each baseline tree's run each go N times,
interleaved (loop, this tree, baselines, loop, ...), every run from an empty cache, and the
table gives the median (min-max) of each, and the median of the per-round ratios to the loop
(a loaded machine drifts between rounds; a ratio within one round compares like with like).
`--interleaved-only` measures only those rows (not the cached, Parquet and 2-rank ones).

Prints a Markdown table (and writes it to `--report`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

MEASURE = """
import json, resource, subprocess, sys, time
t = time.monotonic()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).returncode
wall = time.monotonic() - t
c = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = c.ru_utime + c.ru_stime
print(json.dumps({"rc": rc, "wall": wall, "cpu": cpu, "rss_mb": c.ru_maxrss / 1024}))
"""

LOOP = """
import json, sys
import numpy as np
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
eos = tok.token_to_id("<|endoftext|>")
with open(sys.argv[2], encoding="utf-8") as f, open(sys.argv[3], "wb") as out:
    batch = []
    def flush():
        for e in tok.encode_batch(batch):
            np.asarray(e.ids + [eos], dtype=np.uint16).tofile(out)
        batch.clear()
    for line in f:
        batch.append(json.loads(line)["text"])
        if len(batch) == 512:
            flush()
    flush()
"""

CACHED = """
import sys, time
from trainer.data.hf import hf_data
t = time.monotonic()
d = hf_data(sys.argv[1], tokenizer=sys.argv[2])
print(time.monotonic() - t)
"""


def measure(cmd: list[str], cwd: Path = REPO) -> dict[str, float]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, cwd=cwd, env=e
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["rc"] != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    return out


def make_corpus(out: Path, mb: int) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sources = [
        f.read_text("utf-8", errors="replace")
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("**/*.py"))[:2000]
    ]
    jsonl, parquet = out / "corpus.jsonl", out / "corpus.parquet"
    writer = pq.ParquetWriter(parquet, pa.schema([("text", pa.string())]))
    size, n, batch = 0, 0, []
    with jsonl.open("w", encoding="utf-8") as f:
        while size < mb * 1_000_000:
            text = f"# document {n}\n" + sources[n % len(sources)]
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line.encode())
            batch.append(text)
            n += 1
            if len(batch) == 2048:
                writer.write_table(pa.table({"text": batch}))
                batch = []
    if batch:
        writer.write_table(pa.table({"text": batch}))
    writer.close()
    print(f"corpus: {n:,} documents, {jsonl.stat().st_size / 1e6:.0f} MB JSONL, "
          f"{parquet.stat().st_size / 1e6:.0f} MB Parquet", flush=True)  # fmt: skip
    return jsonl, parquet


def _cell(values: list[float], digits: int = 1, unit: str = "") -> str:
    """The median, with the range when there are several values."""
    med = f"{statistics.median(values):.{digits}f}{unit}"
    if len(values) == 1:
        return med
    return f"{med} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _ratio(runs: list[dict[str, float]], loop: list[dict[str, float]], key: str) -> str:
    """Against the loop: per round when each round has one of both, else of the medians."""
    if runs is loop:
        return "1.00x"
    if len(runs) == len(loop):
        return _cell([r[key] / b[key] for r, b in zip(runs, loop)], 2, "x")
    med = statistics.median(r[key] for r in runs) / statistics.median(b[key] for b in loop)
    return f"{med:.2f}x"


def _table(rows: dict[str, list[dict[str, float]]], loop: str) -> list[str]:
    lines = [
        "| run | wall s | CPU s (all processes) | peak RSS of one process, MB | wall vs loop "
        "| CPU vs loop |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in rows.items():
        lines.append(
            f"| {name} | {_cell([r['wall'] for r in runs])} | {_cell([r['cpu'] for r in runs])} | "
            f"{statistics.median(r['rss_mb'] for r in runs):.0f} | "
            f"{_ratio(runs, rows[loop], 'wall')} | {_ratio(runs, rows[loop], 'cpu')} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path, default=None)
    ap.add_argument(
        "--baseline-tree", type=Path, action="append", default=[], help="an older checkout"
    )
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repeats")
    ap.add_argument("--interleaved-only", action="store_true")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    out.mkdir(parents=True, exist_ok=True)
    tok = out / "tok" / "tokenizer.json"
    if not tok.exists():
        subprocess.run(
            [sys.executable, "scripts/train_tokenizer.py", str(tok.parent),
             f"--vocab-size={args.vocab}"], cwd=REPO, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    jsonl, parquet = make_corpus(out, args.mb)
    train = [
        "-m", "trainer.train", "model=gpt_tiny", "logger=none", "data=hf",
        f"data.tokenizer={tok}", f"model.vocab_size={args.vocab}", "train.max_steps=1",
        "train.micro_batch_size=8", "train.grad_accum_steps=1", "eval.every_steps=0",
        "checkpoint.every_steps=0",
    ]  # fmt: skip
    rows: dict[str, list[dict[str, float]]] = {}

    def fresh() -> None:
        shutil.rmtree(out / ".cumulus-cache", ignore_errors=True)

    def run(name: str, cmd: list[str], cwd: Path = REPO) -> None:
        rows.setdefault(name, []).append(measure(cmd, cwd))
        r = rows[name][-1]
        print(
            f"{name}: {r['wall']:.1f} s wall, {r['cpu']:.1f} s CPU, {r['rss_mb']:.0f} MB",
            flush=True,
        )

    loop = "plain streaming loop (JSONL)"
    one_rank = "cumulus data=hf JSONL, 1 rank, first step"
    for _ in range(args.rounds):
        run(loop, [sys.executable, "-c", LOOP, str(tok), str(jsonl), str(out / "loop.bin")])
        fresh()
        run(one_rank, [sys.executable, *train, f"data.path={jsonl}", f"hydra.run.dir={out / 'r1'}"])
        for tree in args.baseline_tree:
            fresh()
            run(f"baseline tree {tree.name}, JSONL, 1 rank, first step",
                [sys.executable, *train, f"data.path={jsonl}", f"hydra.run.dir={out / 'r5'}"],
                tree.resolve())  # fmt: skip
    notes: list[str] = []
    if not args.interleaved_only:
        notes = _other_rows(run, fresh, train, out, jsonl, parquet, tok)
    lines = [
        f"Corpus: {jsonl.stat().st_size / 1e6:.0f} MB JSONL / {parquet.stat().st_size / 1e6:.0f}"
        f" MB Parquet, BPE vocabulary {args.vocab}, {os.cpu_count()} cores"
        + (f", {args.rounds} interleaved rounds (median, min-max)." if args.rounds > 1 else "."),
        "",
        *_table(rows, loop),
        *(["", *notes] if notes else []),
    ]
    report = "\n".join(lines)
    print(report)
    if args.report:
        args.report.write_text(report + "\n")


def _other_rows(
    run: Any, fresh: Any, train: list[str], out: Path, jsonl: Path, parquet: Path, tok: Path
) -> list[str]:
    """The cached start, Parquet and 2 ranks (after the interleaved rows; the 1-rank run's
    shards are the cache): the table's other rows, and the notes under it."""
    run("cumulus data=hf JSONL, cached, first step", [sys.executable, *train,
        f"data.path={jsonl}", f"hydra.run.dir={out / 'r2'}"])  # fmt: skip
    e = {**os.environ, "OMP_NUM_THREADS": "1"}
    cached = subprocess.run(
        [sys.executable, "-c", CACHED, str(jsonl), str(tok)],
        cwd=REPO, env=e, capture_output=True, text=True, check=True,
    )  # fmt: skip
    cached_s = float(cached.stdout)
    fresh()
    run("cumulus data=hf Parquet, 1 rank, first step", [sys.executable, *train,
        f"data.path={parquet}", f"hydra.run.dir={out / 'r3'}"])  # fmt: skip
    fresh()
    run("cumulus data=hf JSONL, 2 ranks (torchrun), first step", [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        *train, f"data.path={jsonl}", f"hydra.run.dir={out / 'r4'}"])  # fmt: skip
    logs = list((out / ".cumulus-cache").glob("*/builds.log"))
    builds = sum(len(p.read_text().splitlines()) for p in logs)
    return [
        f"Cached start: `hf_data(...)` on the tokenized corpus takes {cached_s:.2f} s "
        "(index check and memory maps; the corpus is not re-read).",
        f"2 ranks: tokenizer builds recorded in builds.log: {builds} (the job tokenized once).",
    ]


if __name__ == "__main__":
    main()
