"""Train a byte-level BPE tokenizer on local text with the `tokenizers` library (no download)
and save it as one `tokenizer.json` (for `data.tokenizer=`, `scripts/prepare_bin.py
--tokenizer` and transformers' `PreTrainedTokenizerFast`).

    python scripts/train_tokenizer.py OUT [--source stdlib|FILE|DIR] [--text-field text]
        [--vocab-size 8192]

OUT is a directory (tokenizer.json goes in it) or a path ending in .json. The source is this
Python's standard-library sources by default; a text file or a directory of them (one
document per file); or dataset records as `data=hf` reads them: a JSON Lines (`.jsonl`),
JSON array (`.json`) or Parquet file, or a `datasets` `save_to_disk` directory (its `train`
split), one document per record's `--text-field`. Records are streamed a few MB at a time
through the same readers as training (`trainer.data.shards`), so memory does not grow with
the corpus and the tokenizer sees the texts, never the JSON around them. `<|endoftext|>` is a
special token that separates documents. Byte-level: every text round-trips exactly through
encode/decode.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.prepare_bin import files_of  # noqa: E402
from trainer.config.errors import UserError  # noqa: E402
from trainer.data.shards import Source, documents  # noqa: E402

EOS = "<|endoftext|>"
# The trainer's keys in the readers' messages, as this script's options.
OPTIONS = {"data.text_field": "--text-field", "data.path": "--source"}


def source_of(source: str, field: str) -> Source:
    """`--source` as the readers' `Source`: records (data=hf's kinds) or text files."""
    from trainer.data.hf import is_dataset, sources

    path = Path(source).expanduser()
    if source != "stdlib" and is_dataset(path):
        return sources(path, field)[0]  # data=hf's own choice of reader (and its errors)
    files = files_of(source)
    if not files or not all(f.is_file() for f in files):
        raise UserError(
            f"data.path: {source} is not stdlib, a text file, a directory of text files, a "
            ".jsonl/.json/.parquet file or a datasets save_to_disk directory"
        )
    # One text file: read in pieces (cut where byte-level BPE splits anyway), not whole.
    return Source("text", (files[0],)) if len(files) == 1 else Source("files", tuple(files))


def train(texts: Iterator[list[str]], vocab_size: int, min_frequency: int = 2) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts` (batches of documents)."""
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
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


class Counted:
    """Batches of documents passed through, counting them and keeping the first one (for
    the round-trip check) and the first error (tokenizers reports its own otherwise)."""

    def __init__(self, batches: Iterator[list[str]]) -> None:
        self.batches, self.docs, self.nbytes = batches, 0, 0
        self.first: str | None = None
        self.error: UserError | None = None

    def __iter__(self) -> Iterator[list[str]]:
        try:
            for batch in self.batches:
                if self.first is None and batch:
                    self.first = batch[0]
                self.docs += len(batch)
                self.nbytes += sum(len(t.encode("utf-8", errors="replace")) for t in batch)
                yield batch
        except UserError as exc:
            self.error = exc  # ends the iteration: the caller raises it after training


def message(exc: UserError) -> str:
    text = str(exc)
    for key, option in OPTIONS.items():
        text = text.replace(f"{key}=", option).replace(key, option)
    return f"error: {text}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--source", default="stdlib")
    ap.add_argument("--text-field", default="text", help="the records' text field")
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args()
    if args.vocab_size < 257:
        raise SystemExit("error: --vocab-size must exceed the 256 byte tokens plus <|endoftext|>")
    try:
        source = source_of(args.source, args.text_field)
        counted = Counted(documents(source))
        tok = train(iter(counted), args.vocab_size)
        if counted.error is not None:
            raise counted.error
    except UserError as exc:
        raise SystemExit(message(exc)) from None
    if not counted.docs:
        raise SystemExit(f"error: --source {args.source}: no documents")
    out = args.out if args.out.suffix == ".json" else args.out / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    sample = counted.first or ""
    ids = tok.encode(sample).ids
    same = tok.decode(ids) == sample
    print(
        f"{out}: vocabulary {tok.get_vocab_size()}, trained on {counted.docs:,} documents "
        f"({counted.nbytes / 1e6:.1f} MB) of {source.name}; the first: "
        f"{len(sample.encode())} bytes -> {len(ids)} tokens "
        f"({len(sample.encode()) / max(1, len(ids)):.2f} bytes/token), round trip "
        f"{'exact' if same else 'NOT exact'}"
    )


if __name__ == "__main__":
    main()
