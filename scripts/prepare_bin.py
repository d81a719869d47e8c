"""Write nanoGPT-style token files: OUT/train.bin and OUT/val.bin, little-endian uint16.

    python scripts/prepare_bin.py OUT [--source stdlib|PATH] [--tokenizer PATH | --tiktoken gpt2]
        [--text-field text] [--workers N]

`--source`: `stdlib`, a directory or file of text (one document per file), or a dataset file
as `data=hf` reads it (.jsonl, .parquet, a save_to_disk directory; one document per record's
`--text-field`). Tokens are the text's bytes (ids 0-255) unless `--tokenizer` names a
tokenizer.json (or a tokenizer directory; scripts/train_tokenizer.py writes one), each
document then ending with its end-of-text token, or `--tiktoken ENCODING` is given and
tiktoken has that encoding offline. Every tenth document goes to val.bin, as in
`data.path=stdlib` and `data=hf`.

The corpus is streamed through the same pipeline as training (`trainer.data.shards`: worker
processes, shards cached under `.cumulus-cache/` or `--cache-dir`), and the .bin files are
written from the memory-mapped shards block by block: memory does not grow with the corpus.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config.errors import UserError
from trainer.data.shards import HOME_CACHE, Source, TokenView, open_shards

BLOCK = 1 << 22  # tokens copied at a time


def files_of(source: str) -> list[Path]:
    if source == "stdlib":
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    path = Path(source)
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def source_of(source: str, field: str) -> Source:
    path = Path(source)
    if source != "stdlib" and path.is_dir() and (path / "dataset_info.json").exists():
        return Source("saved", (path,), field)
    if path.suffix in (".jsonl", ".json"):
        return Source("jsonl", (path,), field)
    if path.suffix == ".parquet":
        return Source("parquet", (path,), field)
    files = files_of(source)
    if len(files) < 2:
        raise SystemExit(f"--source {source}: need at least 2 files (one for val.bin)")
    return Source("files", tuple(files))


def write(view: TokenView, out: Path) -> int:
    with out.open("wb") as f:
        for a in range(0, len(view), BLOCK):
            block = view.read(a, min(a + BLOCK, len(view)))
            if len(block) and int(block.max()) >= 1 << 16:
                raise SystemExit("token ids do not fit in uint16")
            block.astype("<u2").tofile(f)
    return len(view)


def tiktoken_bins(source: Source, encoding: str, out: Path) -> None:
    """tiktoken: one document at a time, appended (text files only)."""
    import tiktoken

    enc = tiktoken.get_encoding(encoding)
    with (out / "train.bin").open("wb") as train, (out / "val.bin").open("wb") as val:
        for i, p in enumerate(source.paths):
            ids = enc.encode_ordinary(p.read_bytes().decode("utf-8", errors="replace"))
            np.asarray(ids, dtype="<u2").tofile(val if i % 10 == 0 else train)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--source", default="stdlib")
    ap.add_argument("--tiktoken", default=None, help="encoding name, e.g. gpt2")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json or tokenizer directory")
    ap.add_argument("--text-field", default="text", help="the records' text field")
    ap.add_argument("--workers", type=int, default=None, help="tokenizer processes")
    ap.add_argument("--cache-dir", default=None, help="where the token shards go")
    args = ap.parse_args()
    source = source_of(args.source, args.text_field)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiktoken:
        if source.kind != "files":
            raise SystemExit("--tiktoken reads text files only; use --tokenizer for records")
        tiktoken_bins(source, args.tiktoken, args.out)
        return
    cache_dir = args.cache_dir or (str(HOME_CACHE) if args.source == "stdlib" else None)
    try:
        store = open_shards(source, args.tokenizer, cache_dir, args.workers)
    except UserError as exc:
        raise SystemExit(f"error: {str(exc).replace('data.tokenizer', '--tokenizer')}") from None
    held_out = np.arange(len(store.doc_offsets) - 1) % 10 == 0
    for name, selected in (("train", ~held_out), ("val", held_out)):
        n = write(TokenView(store, selected), args.out / f"{name}.bin")
        print(f"{args.out / f'{name}.bin'}: {n:,} tokens")


if __name__ == "__main__":
    main()
