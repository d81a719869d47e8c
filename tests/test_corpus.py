"""Corpus-scale data (`trainer.data.shards`): streamed, tokenized once per job by worker
processes into memory-mapped shards, resumable after a kill, refused when the index is
crafted. Tokens are compared with the tokenizers library's own encoding of each document."""

from __future__ import annotations

import itertools
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from tests import ranks
from tests.conftest import REPO, TINY, train_in_process, train_records
from tests.ranks import explain, launch, run_cli, torchrun_cmd

tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

from trainer.data import shards  # noqa: E402
from trainer.data.shards import Source, TokenView, open_shards  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
VOCAB = 512
SMALL_CHUNKS = 60_000  # source bytes per shard: several shards from a small corpus


def records(n: int = 40) -> list[dict[str, str]]:
    files = sorted(STDLIB.glob("*.py"))[:n]
    return [{"name": f.name, "text": f.read_text("utf-8", errors="replace")} for f in files]


def write_jsonl(path: Path, recs: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    cmd = [sys.executable, "scripts/train_tokenizer.py", str(out), f"--vocab-size={VOCAB}"]
    proc = launch(cmd, 180.0)
    assert proc.returncode == 0, explain(proc)
    return out / "tokenizer.json"


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "CHUNK_BYTES", SMALL_CHUNKS)


def reference(tokenizer: Path, texts: list[str]) -> list[list[int]]:
    """Each document encoded on its own, then the end-of-text token: independent of shards."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    return [tok.encode(t).ids + ([] if eos is None else [eos]) for t in texts]


def documents(store: shards.TokenStore) -> list[list[int]]:
    o = store.doc_offsets
    return [store.read(int(a), int(b)).tolist() for a, b in itertools.pairwise(o)]


@pytest.mark.launches
def test_formats_give_the_reference_tokens_and_an_edit_retokenizes(
    tokenizer: Path, tmp_path: Path, small_chunks: None
) -> None:
    recs = records()
    want = reference(tokenizer, [r["text"] for r in recs])
    ds = datasets.Dataset.from_list(recs)
    jsonl = write_jsonl(tmp_path / "j" / "docs.jsonl", recs)
    (tmp_path / "p").mkdir()
    ds.to_parquet(str(tmp_path / "p" / "docs.parquet"))
    ds.save_to_disk(str(tmp_path / "s" / "docs"))
    got = {}
    for kind, path in {
        "jsonl": jsonl,
        "parquet": tmp_path / "p" / "docs.parquet",
        "saved": tmp_path / "s" / "docs",
    }.items():
        store = open_shards(Source(kind, (path,)), tokenizer, workers=2, quiet=True)
        assert len(store.starts) > 3, f"{kind}: several shards"
        assert store.dtype == np.dtype("<u2")
        got[kind] = documents(store)
        assert got[kind] == want, kind
    # Editing one document is a new shard set with that document's new tokens.
    recs[3] = {**recs[3], "text": recs[3]["text"] + "\n# edited\n"}
    time.sleep(0.01)
    write_jsonl(jsonl, recs)
    store = open_shards(Source("jsonl", (jsonl,)), tokenizer, workers=1, quiet=True)
    assert documents(store) == reference(tokenizer, [r["text"] for r in recs])
    assert len(list((jsonl.parent / ".cumulus-cache").glob("*/index.json"))) == 2


@pytest.mark.launches
def test_views_select_documents_like_a_list(tokenizer: Path, tmp_path: Path) -> None:
    recs = records(12)
    store = open_shards(
        Source("jsonl", (write_jsonl(tmp_path / "d.jsonl", recs),)), tokenizer, quiet=True
    )
    want = reference(tokenizer, [r["text"] for r in recs])
    keep = np.arange(len(recs)) % 3 != 0
    view = TokenView(store, keep)
    flat = [t for i, d in enumerate(want) if keep[i] for t in d]
    assert view.read(0, len(view)).tolist() == flat
    assert view.read(1000, 5000).tolist() == flat[1000:5000]
    assert np.diff(view.offsets()).tolist() == [len(d) for i, d in enumerate(want) if keep[i]]


@pytest.mark.launches
def test_a_text_file_read_in_pieces_gives_the_whole_files_tokens(
    tokenizer: Path, tmp_path: Path, small_chunks: None
) -> None:
    """`data.path=FILE` with a tokenizer: one document, read in pieces of CHUNK_BYTES."""
    path = tmp_path / "one.txt"
    path.write_text("".join(r["text"] for r in records(30)))
    store = open_shards(Source("text", (path,)), tokenizer, workers=2, quiet=True)
    assert len(store.starts) > 3, "several pieces"
    assert store.read(0, len(store)).tolist() == reference(tokenizer, [path.read_text()])[0]


BUILD = """
import sys, time
sys.path.insert(0, {repo!r})
from trainer.data import shards
shards.CHUNK_BYTES = {chunk}
slow = shards.encode
def encode(chunk):
    time.sleep({sleep})
    return slow(chunk)
shards.encode = encode
store = shards.open_shards(shards.Source("jsonl", ({path!r},)), {tok!r}, workers={workers})
import resource
print("maxrss_kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, len(store))
"""


def build_script(path: Path, tok: Path | None, chunk: int, sleep: float, workers: int) -> str:
    tok_arg = None if tok is None else str(tok)
    return BUILD.format(
        repo=str(REPO), chunk=chunk, sleep=sleep, path=str(path), tok=tok_arg, workers=workers
    )


@pytest.mark.launches
def test_killed_tokenization_resumes_from_its_committed_shards(
    tokenizer: Path, tmp_path: Path, small_chunks: None
) -> None:
    recs = records(40)
    path = write_jsonl(tmp_path / "k" / "docs.jsonl", recs)
    script = build_script(path, tokenizer, SMALL_CHUNKS, 0.3, workers=1)
    build = ranks.start([sys.executable, "-c", script], 120)  # a fresh interpreter
    cache = path.parent / ".cumulus-cache"
    deadline = time.monotonic() + 60
    try:
        while len(list(cache.glob("*/chunk-*.docs"))) < 3 and time.monotonic() < deadline:
            assert build.poll() is None, "the build ended before it was killed"
            time.sleep(0.05)
    finally:
        build.collect()  # SIGKILL
    committed = {p: p.stat().st_ino for p in cache.glob("*/chunk-*")}
    assert len(committed) >= 6 and not list(cache.glob("*/index.json")), "killed mid-way"
    store = open_shards(Source("jsonl", (path,)), tokenizer, workers=2, quiet=True)
    assert {p: p.stat().st_ino for p in committed} == committed, "committed shards kept"
    assert documents(store) == reference(tokenizer, [r["text"] for r in recs])
    assert len(store.starts) - 1 > len(committed) // 2, "the rest was tokenized on rerun"
    log = next(cache.glob("*/builds.log")).read_text().splitlines()
    assert len(log) == 2, "one build, resumed once"


@pytest.mark.launches
def test_damaged_shards_are_redone_and_a_crafted_index_is_refused(
    tokenizer: Path, tmp_path: Path
) -> None:
    recs = records(20)
    path = write_jsonl(tmp_path / "docs.jsonl", recs)
    src = Source("jsonl", (path,))
    store = open_shards(src, tokenizer, quiet=True)
    want = documents(store)
    shard = store.root / "chunk-000000.bin"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    assert documents(open_shards(src, tokenizer, quiet=True)) == want, "truncated: redone"
    index = store.root / "index.json"
    good = json.loads(index.read_text())
    for crafted in (
        {**good, "dtype": "|O"},
        {**good, "tokens": good["tokens"] + 7},
        {**good, "format": "pickle"},
    ):
        index.write_text(json.dumps(crafted))
        with pytest.raises(shards.UserError, match="not a shard index cumulus wrote"):
            open_shards(src, tokenizer, quiet=True)
    # Through the trainer: one paragraph, exit 2, no traceback.
    proc = run_cli(
        [*TINY, "data=hf", f"data.path={path}", f"data.tokenizer={tokenizer}",
         f"hydra.run.dir={tmp_path / 'run'}"]
    )  # fmt: skip
    assert proc.returncode == 2, explain(proc)
    assert "not a shard index cumulus wrote" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.launches
def test_peak_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    """Peak RSS while tokenizing (bytes, in one process) grows < 20% when the corpus grows 4x."""
    text = "".join(r["text"] for r in records(60))
    peak = {}
    for n in (1, 4):
        recs = [{"text": text[i : i + 4000]} for i in range(0, len(text), 4000)] * (4 * n)
        path = write_jsonl(tmp_path / f"x{n}" / "docs.jsonl", recs)
        script = build_script(path, None, 1 << 20, 0.0, workers=1)
        out = launch([sys.executable, "-c", script], 120)  # a fresh process: its own peak RSS
        assert out.returncode == 0, out.stderr
        kb, n_tokens = map(int, out.stdout.split()[1:])
        assert n_tokens == path.stat().st_size - 0 or n_tokens > 0
        peak[n] = kb
    assert peak[4] < 1.2 * peak[1], peak


@pytest.mark.multiproc
def test_two_ranks_tokenize_once_and_resume_exactly(tokenizer: Path, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", records(30))
    common = [
        *TINY, "data=hf", f"data.path={path}", f"data.tokenizer={tokenizer}",
        f"model.vocab_size={VOCAB}", "data.block_size=64", "train.micro_batch_size=4",
    ]  # fmt: skip
    run_dir = tmp_path / "two"
    proc = launch(
        [*torchrun_cmd(2), "-m", "trainer.train", *common, "train.max_steps=4",
         "checkpoint.every_steps=2", f"hydra.run.dir={run_dir}"],
        180,
    )  # fmt: skip
    assert proc.returncode == 0, explain(proc)
    logs = list((path.parent / ".cumulus-cache").glob("*/builds.log"))
    assert len(logs) == 1 and len(logs[0].read_text().splitlines()) == 1, "tokenized once"
    full = [r["train/loss"] for r in train_records(_metrics(run_dir))]
    # One process resumes the 2-rank run's step-2 checkpoint from the memory-mapped shards.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    ckpt = sorted((run_dir / "checkpoints").iterdir())[0]
    got = train_in_process(
        [*common, "train.max_steps=4", "train.grad_accum_steps=4", f"checkpoint.resume={ckpt}"],
        resumed,
    )
    losses = [r["train/loss"] for r in train_records(got)]
    assert [r["step"] for r in train_records(got)] == [3, 4]
    np.testing.assert_allclose(losses, full[2:], rtol=1e-5)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _die(chunk: shards.Chunk) -> None:
    os._exit(3)  # a worker killed mid-chunk (e.g. by the OOM killer)


def test_a_dying_worker_is_one_paragraph_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", records(4))
    monkeypatch.setattr(shards, "encode", _die)  # forked workers inherit it
    with pytest.raises(shards.UserError, match="worker process died") as err:
        open_shards(Source("jsonl", (path,)), None, workers=2, quiet=True)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
