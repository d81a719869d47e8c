"""Train a byte-level BPE tokenizer on local text with the `tokenizers` library (no download)
and save it as one `tokenizer.json` (for `data.tokenizer=`, `scripts/prepare_bin.py
--tokenizer` and transformers' `PreTrainedTokenizerFast`).

    python scripts/train_tokenizer.py OUT [--source stdlib|FILE|DIR] [--vocab-size 8192]

OUT is a directory (tokenizer.json goes in it) or a path ending in .json. The source is this
Python's standard-library sources by default. `<|endoftext|>` is a special token that
separates documents. Byte-level: every text round-trips exactly through encode/decode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.prepare_bin import files_of  # noqa: E402

EOS = "<|endoftext|>"


def train(files: list[Path], vocab_size: int, min_frequency: int = 2):  # -> tokenizers.Tokenizer
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise SystemExit("error: tokenizers is missing; pip install 'cumulus[hf]'") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def texts():
        for f in files:
            yield f.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(texts(), trainer=trainer, length=len(files))
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--source", default="stdlib")
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args()
    if args.vocab_size < 257:
        raise SystemExit("error: --vocab-size must exceed the 256 byte tokens plus <|endoftext|>")
    files = files_of(args.source)
    if not files:
        raise SystemExit(f"error: --source {args.source}: no files")
    tok = train(files, args.vocab_size)
    out = args.out if args.out.suffix == ".json" else args.out / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    sample = files[0].read_text(encoding="utf-8", errors="replace")
    ids = tok.encode(sample).ids
    same = tok.decode(ids) == sample
    print(
        f"{out}: vocabulary {tok.get_vocab_size()}, trained on {len(files)} files; "
        f"{files[0].name}: {len(sample.encode())} bytes -> {len(ids)} tokens "
        f"({len(sample.encode()) / max(1, len(ids)):.2f} bytes/token), round trip "
        f"{'exact' if same else 'NOT exact'}"
    )


if __name__ == "__main__":
    main()
