"""`data=hf`: language-modelling data from dataset files (local, no download): JSON Lines,
Parquet, or a directory written by `datasets`' `save_to_disk`. Each record's `text_field` is
one document; documents are streamed and tokenized once per job (bytes, or `tokenizer=` a
tokenizer.json) into memory-mapped token shards (`trainer.data.shards`), cached next to the
data or in `cache_dir`, keyed by the files' path, size and mtime and the tokenizer. Samples
are packed blocks or one padded sample per document, through the same split-invariant
sampler as every dataset.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer.config.errors import UserError
from trainer.data import DataSplits
from trainer.data.shards import Source, TokenStore, TokenView, load_saved, open_shards
from trainer.data.text import collate, decode_bytes, token_samples
from trainer.data.tokenize import EXTRA, decoder, load_tokenizer, pretrained_tokenizer

SUFFIXES = (".jsonl", ".json", ".parquet")


def is_dataset(path: Path) -> bool:
    """Whether `path` is what data=hf reads (a .jsonl, .json or .parquet file, or a
    `save_to_disk` directory) rather than plain text files."""
    if path.is_dir():
        marks = ("dataset_dict.json", "dataset_info.json", "state.json")
        return any((path / m).is_file() for m in marks)
    return path.suffix in SUFFIXES


def sources(path: Path, field: str, reader: str = "data=hf") -> tuple[Source, Source | None]:
    """(training source, the data's own validation split if it has one)."""
    if not path.exists():
        raise UserError(
            f"data.path: {path} does not exist. {reader} reads a JSON Lines file (.jsonl), a "
            "Parquet file (.parquet) or a datasets save_to_disk directory, from local disk."
        )
    if path.is_dir():
        ds = load_saved(path)  # a one-paragraph error without the datasets library
        import datasets

        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise UserError(f"data.path: {path} has splits {list(ds)}, none named train")
            val = next((s for s in ("validation", "test") if s in ds), None)
            return Source("saved", (path,), field, "train"), (
                None if val is None else Source("saved", (path,), field, val)
            )
        return Source("saved", (path,), field), None
    if path.suffix == ".jsonl":
        return Source("jsonl", (path,), field), None
    if path.suffix == ".json":
        with path.open(encoding="utf-8") as f:
            array = f.read(1024).lstrip().startswith("[")
        return Source("json" if array else "jsonl", (path,), field), None
    if path.suffix == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise UserError(
                f"data.path: reading Parquet needs pyarrow; pip install 'cumulus[{EXTRA}]'"
            ) from None
        return Source("parquet", (path,), field), None
    raise UserError(
        f"data.path: {path} has suffix {path.suffix!r}; {reader} reads {', '.join(SUFFIXES)} "
        "files or a save_to_disk directory (for plain text use data=stdlib with data.path=)"
    )


def hf_data(
    path: str,
    text_field: str = "text",
    tokenizer: str | None = None,
    packed: bool = True,
    block_size: int = 128,
    val_path: str | None = None,
    val_every_nth: int = 10,
    min_sample_len: int = 8,
    cache: bool = True,
    tokenize_workers: int | None = None,
    cache_dir: str | None = None,
    pretrained: str | None = None,
) -> DataSplits:
    """The `data._target_` of `data=hf`. Validation: `val_path`, else the data's own
    validation split, else every `val_every_nth`-th document. `tokenize_workers`: processes
    that tokenize (null: the cores available). `cache_dir`: where the token shards go (null:
    `.cumulus-cache/` next to the data, or `~/.cache/cumulus/shards` where that is read-only).
    `cache=false` tokenizes again into a fresh directory. `pretrained`: the model's
    directory, whose tokenizer is the default (`model.pretrained`)."""
    if not path or path == "required":
        raise ValueError("path: data=hf needs data.path= a .jsonl, .parquet or save_to_disk dir")
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number, got {block_size}")
    if val_every_nth < 2:
        raise ValueError("val_every_nth must be at least 2")
    if tokenize_workers is not None and tokenize_workers < 0:
        raise ValueError(f"tokenize_workers must be >= 0 or null, got {tokenize_workers}")
    tokenizer = pretrained_tokenizer(tokenizer, pretrained)
    source = Path(path).expanduser()
    train_src, val_src = sources(source, text_field)
    if val_path is not None:
        val_src, _ = sources(Path(val_path).expanduser(), text_field)
    if not cache:
        import tempfile

        cache_dir = tempfile.mkdtemp(prefix="cumulus-shards-")

    def load(src: Source) -> TokenStore:
        return open_shards(src, tokenizer, cache_dir, tokenize_workers)

    store = load(train_src)
    n_docs = len(store.doc_offsets) - 1
    if val_src is None:  # every n-th document validates
        held_out = np.arange(n_docs) % val_every_nth == 0
        train, val = TokenView(store, ~held_out), TokenView(store, held_out)
        n_train, n_val, stores = n_docs - int(held_out.sum()), int(held_out.sum()), [store]
    else:
        val_store = load(val_src)
        train, val = TokenView(store), TokenView(val_store)
        n_train, n_val, stores = n_docs, len(val_store.doc_offsets) - 1, [store, val_store]
    if not n_train or not n_val:
        raise UserError(f"data.path: {source} holds too few documents for a train/val split")
    train_ds, val_ds = (
        token_samples(v, v.offsets(), packed, block_size, min_sample_len) for v in (train, val)
    )
    vocab, decode = 256, decode_bytes
    if tokenizer:
        tok = load_tokenizer(tokenizer)
        vocab, decode = tok.get_vocab_size(), decoder(tok)
    biggest = max(s.max_id + 1 for s in stores)
    return DataSplits(
        train=train_ds,
        val=val_ds,
        collate_fn=collate,
        vocab_size=max(vocab, biggest),
        seq_len=block_size,
        decode=decode,
        description=f"{n_train} train / {n_val} val documents from {source} ("
        + ("token cache reused: " if all(s.reused for s in stores) else "tokenized into ")
        + f"{stores[0].root})",
    )
