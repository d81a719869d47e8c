"""data=chat side by side with TRL's SFTTrainer (issue #46): how exact one step is, and how
long preparing 50k conversations takes.

1. Exactness. A tiny pretrained Llama and a ChatML tokenizer with `{% generation %}` markers
   (tests/chat_support.py), 32 conversations. The reference is the float64 gradient of the
   supervised cross-entropy summed over each conversation run alone, divided by the number
   of supervised targets (transformers' own `return_assistant_tokens_mask`). Against it, the
   step-1 gradient of TRL's SFTTrainer (`assistant_only_loss=True`, fp32, accumulation 1/4/8,
   packing off and on; and once at its default CPU precision, bf16) and of cumulus
   (`data=chat`, packed and padded, accumulation 1/4/8; 2 ranks DDP, FSDP2, dist.cp=2).
2. Preparation time. 50k generated conversations (JSON Lines, a BPE of 8,192 tokens), from
   the file to a dataset ready to train (packed, max_length 1024): TRL's dataset preparation
   (`Dataset.from_json` and `SFTTrainer(...)`, its default one process and
   `dataset_num_proc=2`) against `data=chat` (tokenizing with its default workers, the
   cores available, then selecting and packing). Each run is a fresh process with a fresh
   cache; rounds are interleaved; wall and CPU seconds (user+sys, all processes) and the
   peak RSS of the largest process. A 3x larger set shows whether cumulus's memory grows.

    pip install -c constraints-cpu.txt -e '.[hf,bench]'
    python scripts/bench_chat.py [--conversations 50000] [--rounds 2] [--report FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MAX_LENGTH = 256  # exactness: every conversation fits
PREP_LENGTH = 1024
N_GRAD = 32
ACCUMS = (1, 4, 8)


# --------------------------------------------------------------------------- exactness


def reference(model_dir: Path, tok: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The float64 full-batch gradient (transformers' masks and model)."""
    import torch
    import torch.nn.functional as F
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.config.use_cache = False
    convs = []
    for row in rows:
        out = tok.apply_chat_template(
            row["messages"], return_dict=True, return_assistant_tokens_mask=True
        )
        convs.append((out["input_ids"], out["assistant_masks"]))
    total = sum(sum(m[1:]) for _, m in convs)
    for ids, mask in convs:
        logits = model(input_ids=torch.tensor(ids)[None]).logits[0, :-1]
        targets = torch.tensor(ids[1:]).masked_fill(torch.tensor(mask[1:]) == 0, -100)
        (F.cross_entropy(logits, targets, reduction="sum") / total).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def relative_error(got: dict[str, Any], want: dict[str, Any]) -> float:
    diff = sum(float((got[n].double() - want[n]).pow(2).sum()) for n in want)
    return math.sqrt(diff / sum(float(want[n].pow(2).sum()) for n in want))


def trl_gradient(
    model_dir: Path, tok: Any, rows: list[dict[str, Any]], packing: bool, accum: int, bf16: bool
) -> dict[str, Any]:
    """The gradient SFTTrainer is about to apply at its first optimizer step, which covers
    the whole data set (a batch of ceil(rows / accum), max_steps=1)."""
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    grads: dict[str, Any] = {}

    class Grab(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not grads:
                for n, p in kw["model"].named_parameters():
                    grads[n] = p.grad.detach().clone()

    def trainer(batch: int) -> Any:
        config = SFTConfig(
            output_dir=tempfile.mkdtemp(prefix="trl-"),
            use_cpu=True,
            bf16=bf16,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accum,
            max_steps=1,
            optim="sgd",
            learning_rate=0.1,
            max_grad_norm=0.0,  # no clipping before the gradient is read
            report_to=[],
            assistant_only_loss=True,
            packing=packing,
            max_length=MAX_LENGTH,
            gradient_checkpointing=False,
            save_strategy="no",
            disable_tqdm=True,
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        ds = datasets.Dataset.from_list(rows)
        return SFTTrainer(
            model=model, args=config, train_dataset=ds, processing_class=tok, callbacks=[Grab()]
        )

    n = len(trainer(1).train_dataset)  # rows after packing
    trainer(math.ceil(n / accum)).train()
    return grads


def cumulus_gradient(
    model_dir: Path, data: Path, val: Path, packed: bool, accum: int, run: Path, ranks: list[str]
) -> dict[str, Any]:
    """The gradient cumulus applies at step 1 over the whole data set (8 epochs in the
    global batch: divisible by every accumulation and rank count, the same mean)."""
    import torch

    from trainer.api import compose
    from trainer.config.cli import to_config
    from trainer.run.assemble import build_data

    args = [
        "model=hf_llama",
        f"model.pretrained={model_dir}",
        "data=chat",
        f"data.path={data}",
        f"data.val_path={val}",
        f"data.max_length={MAX_LENGTH}",
        f"data.packed={str(packed).lower()}",
        "logger=none",
        "optim=sgd",
        "scheduler=constant",
        "train.clip_grad_norm=null",
        "train.max_steps=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
    ]
    rows = len(build_data(to_config(compose(args))[0].data)[0].train)
    world = 2 if ranks else 1
    args += [
        f"train.global_batch_size={8 * rows}",
        f"train.micro_batch_size={8 * rows // (accum * world)}",
        "+callbacks.dump._target_=tests.chat_support.DumpAllGrads",
        f"+callbacks.dump.path={run}.pt",
        f"hydra.run.dir={run}",
        *ranks,
    ]
    launcher = [sys.executable]
    if ranks:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*launcher, "-m", "trainer.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return torch.load(f"{run}.pt", weights_only=True)


def exactness(root: Path) -> list[str]:
    from tests.chat_support import conversations, pretrained, write_jsonl

    model_dir, tok = pretrained(root)
    rows = conversations(N_GRAD, seed=21, max_turns=2)
    data = write_jsonl(root / "chat.jsonl", rows)
    val = write_jsonl(root / "val.jsonl", conversations(4, seed=99, max_turns=1))
    want = reference(model_dir, tok, rows)
    table = [
        "| trainer | layout | packing | accumulation | relative error |",
        "|---|---|---|---|---|",
    ]
    for packing in (False, True):
        for accum in ACCUMS:
            err = relative_error(trl_gradient(model_dir, tok, rows, packing, accum, False), want)
            table.append(
                f"| TRL SFTTrainer, fp32 | 1 process | {on(packing)} | {accum} | {err:.1e} |"
            )
    err = relative_error(trl_gradient(model_dir, tok, rows, False, 4, True), want)
    table.append(f"| TRL SFTTrainer, default precision (bf16) | 1 process | off | 4 | {err:.1e} |")
    runs = root / "cumulus"
    runs.mkdir()
    for packed in (False, True):
        for accum in ACCUMS:
            got = cumulus_gradient(
                model_dir, data, val, packed, accum, runs / f"{packed}{accum}", []
            )
            table.append(
                f"| cumulus data=chat, fp32 | 1 process | {on(packed)} | {accum} | "
                f"{relative_error(got, want):.1e} |"
            )
    for key, name, extra in (
        ("ddp", "2 ranks DDP", ["dist.strategy=ddp"]),
        ("fsdp", "2 ranks FSDP2", ["dist.strategy=fsdp"]),
        ("cp", "dist.cp=2", ["dist.cp=2"]),
    ):
        got = cumulus_gradient(model_dir, data, val, True, 4, runs / key, extra)
        err = relative_error(got, want)
        table.append(f"| cumulus data=chat, fp32 | {name} | on | 4 | {err:.1e} |")
    return table


def on(flag: bool) -> str:
    return "on" if flag else "off"


# --------------------------------------------------------------------------- preparation


def words() -> list[str]:
    """Words of this Python's standard-library sources: real text, no download."""
    out: list[str] = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]:
        out += [w for w in f.read_text(errors="replace").split() if w.isalpha()]
    return out


def big_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng, vocab = random.Random(seed), words()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(vocab) for _ in range(rng.randint(lo, hi)))

    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(5, 30)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": text(5, 60)})
            messages.append({"role": "assistant", "content": text(10, 120)})
        rows.append({"messages": messages})
    return rows


def bpe_tokenizer(out: Path, rows: list[dict[str, Any]]) -> Path:
    """A byte-level BPE of 8,192 tokens trained on the conversations, ChatML's special tokens
    and the marked template, saved in `out`."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.chat_support import SPECIAL, TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((m["content"] for r in rows[:5000] for m in r["messages"]), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    return out


class PeakRss:
    """The peak resident memory of the largest process among this one and its descendants
    (tokenizer workers, `datasets` map workers), sampled every 0.2 s. Not `ru_maxrss`: Linux
    keeps it across exec, so a child started by a large parent reports the parent's size."""

    def __init__(self) -> None:
        import threading

        import psutil

        self.me, self.peak, self.stop = psutil.Process(), 0.0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(0.2):
            for proc in [self.me, *self.me.children(recursive=True)]:
                try:
                    self.peak = max(self.peak, proc.memory_info().rss / 2**20)
                except Exception:  # a worker that just exited
                    continue

    def mb(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.peak


def _cpu() -> float:
    """CPU seconds of this process and its waited-for children."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child_trl(data: Path, tok_dir: Path, num_proc: int | None) -> dict[str, float]:
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    cache = tempfile.mkdtemp(prefix="trl-cache-")
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=PREP_LENGTH,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-"), use_cpu=True, bf16=False, report_to=[],
        assistant_only_loss=True, packing=True, max_length=PREP_LENGTH,
        dataset_num_proc=num_proc, disable_tqdm=True,
    )  # fmt: skip
    rss, cpu0, start = PeakRss(), _cpu(), time.perf_counter()
    ds = datasets.Dataset.from_json(str(data), cache_dir=cache)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    wall = time.perf_counter() - start
    rows = len(trainer.train_dataset)
    return {"wall_s": wall, "cpu_s": _cpu() - cpu0, "rss_mb": rss.mb(), "rows": rows}


def child_cumulus(data: Path, tok_dir: Path) -> dict[str, float]:
    from trainer.data.chat import chat_data

    rss, cpu0, start = PeakRss(), _cpu(), time.perf_counter()
    # truncation=cut: TRL keeps the first max_length tokens of a longer conversation too.
    splits = chat_data(
        str(data), tokenizer=str(tok_dir), max_length=PREP_LENGTH, truncation="cut", cache=False
    )
    wall = time.perf_counter() - start
    return {"wall_s": wall, "cpu_s": _cpu() - cpu0, "rss_mb": rss.mb(), "rows": len(splits.train)}


def run_child(kind: str, data: Path, tok_dir: Path, extra: str = "") -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", kind, str(data), str(tok_dir), extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def preview_seconds(data: Path, tok_dir: Path, cache: Path, workers: int) -> float:
    """Wall seconds of `python -m trainer.preview` (the whole command, imports included)."""
    cmd = [sys.executable, "-m", "trainer.preview", "data=chat", f"data.path={data}"]
    cmd += [f"data.tokenizer={tok_dir}", f"data.max_length={PREP_LENGTH}", "preview.samples=3"]
    cmd += [f"data.tokenize_workers={workers}", f"data.cache_dir={cache}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return time.perf_counter() - start


def preparation(root: Path, n: int, rounds: int) -> list[str]:
    from tests.chat_support import write_jsonl

    rows = big_conversations(n)
    data = write_jsonl(root / "chat50k.jsonl", rows)
    tok_dir = bpe_tokenizer(root / "tok", rows)
    small = write_jsonl(root / "chat5k.jsonl", rows[:5000])
    del rows
    results: dict[str, list[dict[str, float]]] = {"trl": [], "trl2": [], "cumulus": []}
    for _ in range(rounds):  # interleaved: the machine's load moves
        results["trl"].append(run_child("trl", data, tok_dir))
        results["cumulus"].append(run_child("cumulus", data, tok_dir))
    results["trl2"].append(run_child("trl", data, tok_dir, "2"))
    big = write_jsonl(root / "chat150k.jsonl", big_conversations(3 * n, seed=1))  # freed
    bigger = run_child("cumulus", big, tok_dir)
    trl_wall = statistics.median(r["wall_s"] for r in results["trl"])
    table = [
        f"{n:,} conversations ({data.stat().st_size / 1e6:.0f} MB JSON Lines), BPE of 8,192 "
        f"tokens, max_length {PREP_LENGTH}, packed; {rounds} interleaved rounds (median; "
        "min-max).",
        "",
        "| preparation | wall s | CPU s | peak RSS MB | rows | wall vs TRL |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "trl": "TRL SFTTrainer (dataset_num_proc=None: 1 process)",
        "trl2": "TRL SFTTrainer (dataset_num_proc=2)",
        "cumulus": "cumulus data=chat, truncation=cut (tokenize_workers: the 2 cores)",
    }
    for key, name in names.items():
        rs = results[key]
        wall = [r["wall_s"] for r in rs]
        table.append(
            f"| {name} | {statistics.median(wall):.1f} ({min(wall):.1f}-{max(wall):.1f}) | "
            f"{statistics.median(r['cpu_s'] for r in rs):.1f} | "
            f"{max(r['rss_mb'] for r in rs):.0f} | {rs[0]['rows']:,.0f} | "
            f"{statistics.median(wall) / trl_wall:.2f}x |"
        )
    table.append(
        f"| cumulus data=chat, {3 * n:,} conversations | {bigger['wall_s']:.1f} | "
        f"{bigger['cpu_s']:.1f} | {bigger['rss_mb']:.0f} | {bigger['rows']:,.0f} | |"
    )
    cold = preview_seconds(small, tok_dir, root / "cache5k", 1)
    warm = preview_seconds(small, tok_dir, root / "cache5k", 1)
    cold_all = preview_seconds(data, tok_dir, root / "cache50k", 0)
    warm_all = preview_seconds(data, tok_dir, root / "cache50k", 0)
    table += [
        "",
        "`python -m trainer.preview` (the whole command, imports included), one process "
        "(`data.tokenize_workers=1`, then 0: in the process itself):",
        "",
        "| conversations | first run (tokenizing) s | cached s |",
        "|---|---|---|",
        f"| 5,000 | {cold:.1f} | {warm:.1f} |",
        f"| {n:,} | {cold_all:.1f} | {warm_all:.1f} |",
    ]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--report", default="bench_chat.md")
    parser.add_argument("--skip-exactness", action="store_true")
    parser.add_argument("--skip-preparation", action="store_true")
    parser.add_argument("--child", nargs=4, metavar=("KIND", "DATA", "TOK", "EXTRA"))
    args = parser.parse_args()
    if args.child:
        kind, data, tok, extra = args.child
        if kind == "trl":
            out = child_trl(Path(data), Path(tok), int(extra) if extra else None)
        else:
            out = child_cumulus(Path(data), Path(tok))
        print(json.dumps(out))
        return
    import transformers
    import trl

    from scripts.bench import report

    root = Path(tempfile.mkdtemp(prefix="bench-chat-"))
    lines = [
        f"## data=chat beside TRL (`scripts/bench_chat.py`), {time.strftime('%Y-%m-%d')}",
        "",
        f"transformers {transformers.__version__}, TRL {trl.__version__}; command: "
        f"`python scripts/bench_chat.py --conversations {args.conversations} --rounds "
        f"{args.rounds}`; load average at start {os.getloadavg()[0]:.1f}.",
        "",
    ]
    if not args.skip_exactness:
        lines += ["Step-1 gradient against the float64 full-batch gradient:", ""]
        lines += [*exactness(root / "exact"), ""]
    if not args.skip_preparation:
        lines += [*preparation(root, args.conversations, args.rounds), ""]
    report(lines, args.report)


if __name__ == "__main__":
    main()
