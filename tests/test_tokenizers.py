"""Real tokenizers and dataset files, with no download: scripts/train_tokenizer.py,
`data.tokenizer=`, `scripts/prepare_bin.py --tokenizer`, and `data=hf` over JSON Lines,
Parquet and `save_to_disk` directories."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, train_in_process, train_records
from tests.ranks import env, explain, launch, launch_all

tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

TIMEOUT = 180.0
STDLIB = Path(sysconfig.get_paths()["stdlib"])
VOCAB = 1024


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    proc = launch(
        [sys.executable, "scripts/train_tokenizer.py", str(out), f"--vocab-size={VOCAB}"], TIMEOUT
    )
    assert proc.returncode == 0, explain(proc)
    assert "round trip exact" in proc.stdout, explain(proc)
    return out / "tokenizer.json"


@pytest.mark.launches
def test_trained_tokenizer_round_trips_the_stdlib_sources(tokenizer: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(tokenizer))
    assert tok.get_vocab_size() == VOCAB
    files = sorted(STDLIB.glob("*.py"))
    assert len(files) > 50
    total_bytes = total_tokens = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text, f"{f.name} does not round-trip"
        total_bytes, total_tokens = total_bytes + len(text.encode()), total_tokens + len(ids)
    assert total_bytes / total_tokens > 2.0, "BPE should compress source code over bytes"


@pytest.mark.launches
def test_bpe_bin_files_train_the_gpt2_small_preset(tokenizer: Path, tmp_path: Path) -> None:
    data = tmp_path / "bin"
    prep = launch(
        [sys.executable, "scripts/prepare_bin.py", str(data), f"--tokenizer={tokenizer}"], TIMEOUT
    )
    assert prep.returncode == 0, explain(prep)
    shrunk = [
        "experiment=gpt2_small",
        f"data.path={data}",
        f"data.tokenizer={tokenizer}",  # decodes the text samples
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "data.block_size=32",
        "train.precision=fp32",
        "train.compile=false",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.max_steps=3",
        "scheduler.warmup_steps=1",
        "eval.every_steps=3",
        "eval.max_batches=1",
        "eval.batch_size=4",
        "eval.sample_tokens=8",
        "checkpoint.every_steps=0",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = launch([sys.executable, "-m", "trainer.train", *shrunk], TIMEOUT)
    assert proc.returncode == 0, explain(proc)
    assert "run finished: step 3/3" in proc.stdout, explain(proc)
    assert "--- sample at step 3 ---" in proc.stdout, explain(proc)


def corpus(n: int = 40) -> list[dict[str, str]]:
    return [
        {"name": f.name, "text": f.read_text(encoding="utf-8", errors="replace")}
        for f in sorted(STDLIB.glob("*.py"))[:n]
    ]


@pytest.mark.launches
def test_jsonl_parquet_and_save_to_disk_give_the_same_training(
    tokenizer: Path, tmp_path: Path
) -> None:
    """The same documents in three formats: identical losses step for step (packed=false:
    one padded sample per document), each tokenized once into a cache next to its data."""
    records = corpus()
    files = {
        "jsonl": tmp_path / "jsonl" / "docs.jsonl",
        "parquet": tmp_path / "parquet" / "docs.parquet",
        "saved": tmp_path / "saved" / "docs",
    }
    files["jsonl"].parent.mkdir()
    files["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = datasets.Dataset.from_list(records)
    files["parquet"].parent.mkdir()
    ds.to_parquet(str(files["parquet"]))
    ds.save_to_disk(str(files["saved"]))
    base = [
        *TINY,
        "data=hf",
        f"data.tokenizer={tokenizer}",
        "data.packed=false",
        "data.block_size=64",
        f"model.vocab_size={VOCAB}",
        "train.max_steps=3",
    ]
    losses = {}
    for name, path in files.items():
        run = [*base, f"data.path={path}"]
        got = train_records(train_in_process(run, tmp_path / f"run_{name}"))
        losses[name] = [r["train/loss"] for r in got]
        cache = (path if path.is_dir() else path.parent) / ".cumulus-cache"
        assert len(list(cache.glob("*/index.json"))) == 1, f"{name}: one shard set, built once"
    assert losses["jsonl"] == losses["parquet"] == losses["saved"], losses

    # Changed contents are a new cache entry, never a stale read.
    files["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records[1:]))
    train_in_process([*base, f"data.path={files['jsonl']}"], tmp_path / "run_changed")
    assert len(list((files["jsonl"].parent / ".cumulus-cache").glob("*/index.json"))) == 2


@pytest.mark.launches
def test_bad_tokenizer_and_missing_field_are_one_paragraph(tmp_path: Path) -> None:
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"this is": "not a tokenizer"}')
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"body": r["text"]}) + "\n" for r in corpus(12)))
    common = [sys.executable, "-m", "trainer.train", *TINY]
    procs = launch_all(
        {
            "tokenizer": [*common, f"data.tokenizer={garbage}", f"hydra.run.dir={tmp_path / 'a'}"],
            "field": [*common, "data=hf", f"data.path={docs}", f"hydra.run.dir={tmp_path / 'b'}"],
        },
        TIMEOUT,
    )
    expect = {
        "tokenizer": [f"data.tokenizer: {garbage} does not parse", "train_tokenizer.py"],
        "field": ["data.text_field", "no field 'text'", "'body'"],
    }
    for name, proc in procs.items():
        assert proc.returncode == 2, explain(proc)
        assert "Traceback" not in proc.stderr, explain(proc)
        (error,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
        for part in expect[name]:
            assert part in error, (name, error)


@pytest.mark.launches
def test_export_carries_the_tokenizer(tokenizer: Path, tmp_path: Path) -> None:
    """A transformers model trained on BPE tokens exports as a directory that
    AutoTokenizer and AutoModelForCausalLM both load."""
    transformers = pytest.importorskip("transformers")
    text = tmp_path / "text.py"
    text.write_text("".join(r["text"] for r in corpus(8)))
    run = [
        *[a for a in TINY if not a.startswith("model=")],
        "model=hf_gpt2",
        f"model.config.vocab_size={VOCAB}",
        f"data.path={text}",
        f"data.tokenizer={tokenizer}",
        "data.block_size=32",
        "train.max_steps=2",
        "checkpoint.every_steps=2",
    ]
    train_in_process(run, tmp_path / "run")
    out = tmp_path / "exported"
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    export = [sys.executable, "scripts/export_hf.py", f"checkpoint={ckpt}", f"out={out}"]
    proc = launch([*export, f"data.tokenizer={tokenizer}"])  # a saved path is not taken
    assert proc.returncode == 0, explain(proc)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    sample = corpus(1)[0]["text"][:500]
    assert tok.decode(tok(sample)["input_ids"]) == sample
    assert tok.eos_token == "<|endoftext|>"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == VOCAB


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted (the printable stand-in of each byte -> the byte),
    written out here as the GPT-2 paper's code has it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


# Linux starts a new program's peak RSS at the peak of the process it replaced, so a command
# started straight from pytest (grown to GBs by in-process runs) would report pytest's peak.
# A small interpreter in between starts `cmd` from its own small address space.
MEASURE = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def peak_rss_mb(cmd: list[str], timeout: float) -> tuple[int, float]:
    """(exit code, peak RSS in MB) of `cmd`, from the kernel's own count (wait4)."""
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, *cmd],
        cwd=REPO,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, int(proc.stderr.strip().splitlines()[-1]) / 1024


@pytest.mark.launches
def test_tokenizer_from_jsonl_reads_the_text_field(tmp_path: Path) -> None:
    """`train_tokenizer.py --source corpus.jsonl` (stdlib sources as {"text", "path"} records,
    ~2 MB) trains on each record's text, as data=hf reads it: every vocabulary entry occurs
    in the texts (no JSON escape such as a literal backslash-n made of a newline), the
    vocabulary is >= 99% that of the same texts given as files, and peak RSS stays under
    1 GB. A missing field is one paragraph naming --text-field and the fields there are."""
    docs, size = [], 0
    for f in sorted(STDLIB.glob("*.py")):
        docs.append({"text": f.read_text(encoding="utf-8"), "path": str(f)})
        size += len(docs[-1]["text"].encode())
        if size > 2_000_000:
            break
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    files = tmp_path / "files"
    files.mkdir()
    for i, d in enumerate(docs):
        (files / f"{i:04d}.py").write_text(d["text"], encoding="utf-8")
    vocab, peak = {}, {}
    for name, source in (("jsonl", jsonl), ("files", files)):
        out = tmp_path / f"tok_{name}"
        cmd = [sys.executable, "scripts/train_tokenizer.py", str(out), f"--source={source}"]
        code, peak[name] = peak_rss_mb([*cmd, "--vocab-size=2048"], TIMEOUT)
        assert code == 0, name
        vocab[name] = set(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    assert peak["jsonl"] < 1024, peak

    text = "\n".join(d["text"] for d in docs).encode("utf-8")
    to_byte = byte_decoder()
    merged = vocab["jsonl"] - {"<|endoftext|>"} - set(to_byte)  # single bytes: all 256
    foreign = [t for t in merged if bytes(map(to_byte.get, t)) not in text]
    assert not foreign, f"{len(foreign)} entries the texts do not contain: {sorted(foreign)[:20]}"
    shared = len(vocab["jsonl"] & vocab["files"]) / len(vocab["files"])
    assert shared >= 0.99, f"only {shared:.1%} of the vocabulary in common"

    proc = launch(
        [
            sys.executable,
            "scripts/train_tokenizer.py",
            str(tmp_path / "x"),
            f"--source={jsonl}",
            "--text-field=body",
        ]
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, explain(proc)
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert "--text-field" in line and "no field 'body'" in line and "'path'" in line, line
