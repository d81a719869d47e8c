"""Write nanoGPT-style token files: OUT/train.bin and OUT/val.bin, little-endian uint16.

    python scripts/prepare_bin.py OUT [--source stdlib|PATH] [--tokenizer PATH | --tiktoken gpt2]

Tokens are the text's bytes (ids 0-255) unless `--tokenizer` names a tokenizer.json (or a
tokenizer directory; scripts/train_tokenizer.py writes one), each file then ending with its
end-of-text token, or `--tiktoken ENCODING` is given and tiktoken has that encoding offline.
Every tenth file goes to val.bin, as in `data.path=stdlib`.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np


def files_of(source: str) -> list[Path]:
    if source == "stdlib":
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    path = Path(source)
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--source", default="stdlib")
    ap.add_argument("--tiktoken", default=None, help="encoding name, e.g. gpt2")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json or tokenizer directory")
    args = ap.parse_args()
    encode = lambda b: np.frombuffer(b, dtype=np.uint8)  # noqa: E731
    if args.tokenizer:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from trainer.data.tokenize import eos_id, load_tokenizer
        from trainer.errors import UserError

        try:
            tok = load_tokenizer(args.tokenizer, key="--tokenizer")
        except UserError as exc:
            raise SystemExit(f"error: {exc}") from None
        tail = [] if eos_id(tok) is None else [eos_id(tok)]
        encode = lambda b: np.array(  # noqa: E731
            tok.encode(b.decode("utf-8", errors="replace")).ids + tail, dtype=np.int64
        )
    elif args.tiktoken:
        import tiktoken

        enc = tiktoken.get_encoding(args.tiktoken)
        encode = lambda b: np.array(  # noqa: E731
            enc.encode_ordinary(b.decode("utf-8", errors="replace")), dtype=np.int64
        )
    files = files_of(args.source)
    if len(files) < 2:
        raise SystemExit(f"--source {args.source}: need at least 2 files (one for val.bin)")
    splits: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for i, f in enumerate(files):
        splits["val" if i % 10 == 0 else "train"].append(encode(f.read_bytes()))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, parts in splits.items():
        tokens = np.concatenate(parts)
        if tokens.max() >= 2**16:
            raise SystemExit("token ids do not fit in uint16")
        tokens.astype("<u2").tofile(args.out / f"{name}.bin")
        print(f"{args.out / f'{name}.bin'}: {len(tokens):,} tokens")


if __name__ == "__main__":
    main()
