"""step=cached (task=contrastive, model=hf_encoder, data=pairs): memory, time, exactness.

    python scripts/bench_cached.py [--rounds 3] [--steps 6] [--threads 1] [--skip-st]

1. Memory and time through the trainer (`trainer.api.train`), a BERT-like encoder (4 layers,
   width 128, random init) on 64 pairs of ~40-word texts per step: the whole batch at once
   (micro 64 x accum 1: one micro-batch on one process, so its loss at once, no second pass)
   against step=cached at micro 4 x accum 16. Activation memory: `train.memory_report=true`
   (`activations_bytes` at the tracked peak, trainer/run/memory.py). Time: the median
   `train/step_time_ms` of steps 2.. of each run (memory runs apart, not timed), rounds
   alternating which goes first; median over rounds, min-max in brackets.
2. Side by side with sentence-transformers' `CachedMultipleNegativesRankingLoss`
   (mini-batch 4, scale 20 = 1/0.05, anchors -> positives), the same weights and the same 64
   pairs (token ids), no dropout: the loss, the gradient's relative error against the float64
   gradient of the whole batch, and the step time (loss, backward, SGD step; wall and CPU),
   cumulus's `CachedStep` called as the trainer calls it. The exported directory
   (`save_encoder`, what scripts/export_hf.py writes) is what sentence-transformers loads.

Prints a Markdown section for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.callbacks import Callback
from engine.contrastive import ContrastiveTask
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.step import StepContext
from engine.steps.cached import CachedStep
from trainer.data.pairs import pairs_data
from trainer.models.encoder import encoder

WORDS = [f"w{i}" for i in range(2000)]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT = {
    "vocab_size": len(SPECIAL) + len(WORDS),
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 64,
}
GLOBAL = 64
TIMES = ("wall", "cpu")
CLOCK = "+callbacks.clock._target_=scripts.bench_cached.StepClock"


def write_inputs(root: Path, rows: int) -> tuple[Path, Path, Path]:
    """A word-level tokenizer ([CLS] text [SEP]) and train/val pair files."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    (root / "tok").mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tok" / "tokenizer.json"))
    rng = random.Random(0)

    def row() -> str:
        anchor = rng.choices(WORDS, k=rng.randint(30, 50))
        positive = [w for w in anchor if rng.random() < 0.5] + rng.choices(WORDS, k=15)
        rng.shuffle(positive)
        return json.dumps({"anchor": " ".join(anchor), "positive": " ".join(positive)}) + "\n"

    (root / "train.jsonl").write_text("".join(row() for _ in range(rows)))
    (root / "val.jsonl").write_text("".join(row() for _ in range(16)))
    return root / "tok", root / "train.jsonl", root / "val.jsonl"


class StepClock(Callback):
    """Wall and CPU (user + sys, this process) seconds between optimizer steps, written to
    `path` as JSON at every step (the bench reads the last write)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.marks: list[tuple[float, float]] = []

    def setup(self, ctx: Any) -> None:
        self.marks = [(time.perf_counter(), time.process_time())]

    def on_after_optimizer_step(self, ctx: Any, step: int) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))
        pairs = list(zip(self.marks, self.marks[1:]))
        steps = [{"wall": b[0] - a[0], "cpu": b[1] - a[1]} for a, b in pairs]
        self.path.write_text(json.dumps(steps))


def overrides(files: tuple[Path, Path, Path], micro: int, steps: int, memory: bool) -> list[str]:
    tok, train, val = files
    return [
        "model=hf_encoder",
        *[f"model.config.{k}={v}" for k, v in BERT.items()],
        "task=contrastive",
        "data=pairs",
        f"data.path={train}",
        f"data.val_path={val}",
        f"data.tokenizer={tok}",
        f"train.global_batch_size={GLOBAL}",
        f"train.micro_batch_size={micro}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        f"train.memory_report={str(memory).lower()}",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "logger=none",
    ]


def trainer_figures(root: Path, rounds: int, steps: int) -> dict[str, Any]:
    """Activation bytes (memory report) and median step times of the two ways."""
    from trainer.api import train

    files = write_inputs(root / "data", GLOBAL * steps)
    ways = {"whole": 64, "cached": 4}
    activations = {}
    for name, micro in ways.items():
        run = root / f"memory_{name}"
        train(overrides(files, micro, 2, True), run_dir=run)
        ranks = json.loads((run / "memory_report.json").read_text())["ranks"]
        activations[name] = ranks[0]["activations_bytes"]
        activations[f"{name}_peak"] = ranks[0]["peak_bytes"]
    times: dict[str, list[float]] = {f"{name}_{kind}": [] for name in ways for kind in TIMES}
    for r in range(rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            clock = root / f"clock_{name}{r}.json"
            # By its module's name: the trainer imports it (this file runs as __main__).
            extra = [CLOCK, f"+callbacks.clock.path={clock}"]
            args = [*overrides(files, ways[name], steps, False), *extra]
            train(args, run_dir=root / f"{name}{r}")
            measured = json.loads(clock.read_text())[1:]  # the first step builds Adam's state
            for kind in TIMES:
                times[f"{name}_{kind}"].append(1000 * statistics.median(m[kind] for m in measured))
    return {"activations": activations, "times": times}


# ------------------------------------------------------------------ side by side with ST


def flat_grads(model: torch.nn.Module, names: list[str]) -> torch.Tensor:
    params = dict(model.named_parameters())
    return torch.cat([params[n].grad.double().flatten() for n in names])


def side_by_side(root: Path, rounds: int, steps: int, skip_st: bool) -> dict[str, Any]:
    files = write_inputs(root / "st_data", GLOBAL)
    data = pairs_data(str(files[1]), str(files[2]), tokenizer=str(files[0]), max_length=64)
    samples = [data.train[i] for i in range(GLOBAL)]
    torch.manual_seed(0)
    model = encoder(
        config={**BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    )
    out = root / "exported"
    model.save_encoder(out)  # type: ignore[operator]
    from trainer.models.encoder import encoder_tokenizer

    encoder_tokenizer(str(files[0])).save_pretrained(out)
    names = [n for n, _ in model.named_parameters()]
    task = ContrastiveTask(temperature=0.05)

    # The float64 whole batch.
    reference = encoder(pretrained=str(out)).double()
    whole = data.collate_fn(samples)
    loss = task.window_loss(task.represent(reference, whole), slice(0, GLOBAL)) / GLOBAL
    loss.backward()
    want = flat_grads(reference, names)
    results: dict[str, Any] = {"reference_loss": loss.item()}

    # cumulus: the trainer's CachedStep on 16 micro-batches of 4.
    ours = encoder(pretrained=str(out)).train()
    ctx = StepContext(
        model=ours,
        optimizer=torch.optim.SGD(ours.parameters(), lr=0.0),
        scheduler=None,
        task=task,  # type: ignore[arg-type]
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        clip_grad_norm=None,
    )
    window = [data.collate_fn(samples[i : i + 4]) for i in range(0, GLOBAL, 4)]
    step = CachedStep(chunk_size=4)

    def cumulus_step() -> float:
        result = step(ctx, window)
        return float(result.loss_sum) / int(result.global_count)

    results["cumulus"] = {"loss": cumulus_step()}
    got = flat_grads(ours, names)
    results["cumulus"]["grad_error"] = ((got - want).norm() / want.norm()).item()
    ways = {"cumulus": cumulus_step}

    if not skip_st:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.losses import (
            CachedMultipleNegativesRankingLoss,
        )

        st = SentenceTransformer(str(out), device="cpu")
        st.train()
        loss_fn = CachedMultipleNegativesRankingLoss(st, scale=20.0, mini_batch_size=4)
        features = []
        for side in ("anchor", "positive"):
            texts = data.collate_fn([{"anchor": s[side], "positive": s[side]} for s in samples])
            ids, mask = texts["input_ids"][:, 0], texts["attention_mask"][:, 0]
            features.append({"input_ids": ids, "attention_mask": mask})
        optimizer = torch.optim.SGD(st.parameters(), lr=0.0)
        inner = st[0].auto_model

        def st_step() -> float:
            optimizer.zero_grad(set_to_none=True)
            value = loss_fn(features, None)
            value.backward()
            optimizer.step()
            return float(value.detach())

        results["sentence_transformers"] = {"loss": st_step()}
        got = flat_grads(inner, names)
        error = ((got - want).norm() / want.norm()).item()
        results["sentence_transformers"]["grad_error"] = error
        results["sentence_transformers"]["loads_export"] = True
        ways["sentence_transformers"] = st_step

    for name in ways:
        results[name]["wall_ms"], results[name]["cpu_ms"] = [], []
    for r in range(rounds):
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            wall, cpu = [], []
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                ways[name]()
                wall.append(1000 * (time.perf_counter() - t0))
                cpu.append(1000 * (time.process_time() - c0))
            results[name]["wall_ms"].append(statistics.median(wall))
            results[name]["cpu_ms"].append(statistics.median(cpu))
    return results


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-st", action="store_true", help="no sentence-transformers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trainer = trainer_figures(root, args.rounds, args.steps)
        sbs = side_by_side(root, args.rounds, args.steps, args.skip_st)
    act, times = trainer["activations"], trainer["times"]
    memory_ratio = act["cached"] / act["whole"]
    ratios = {
        kind: [c / w for c, w in zip(times[f"cached_{kind}"], times[f"whole_{kind}"])]
        for kind in TIMES
    }
    date = datetime.date.today().isoformat()
    print(f"\n## step=cached: memory, time, exactness (`scripts/bench_cached.py`), {date}\n")
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.threads} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
        f", load average {os.getloadavg()[0]:.1f}. Command:\n\n"
        f"    python scripts/bench_cached.py --rounds {args.rounds} --steps {args.steps} "
        f"--threads {args.threads}\n"
    )
    print(f"Encoder {BERT}, global batch {GLOBAL} pairs of 30-50 / 15-40 words.\n")
    print("| way | activations at the peak (MB) | tracked peak (MB) | step CPU ms | step wall ms |")
    print("| --- | --- | --- | --- | --- |")
    for name, label in (
        ("whole", "whole batch at once (64 x 1)"),
        ("cached", "step=cached 4 x 16"),
    ):
        print(
            f"| {label} | {act[name] / 2**20:.1f} | {act[name + '_peak'] / 2**20:.1f} | "
            f"{spread(times[name + '_cpu'])} | {spread(times[name + '_wall'])} |"
        )
    cpu, wall = ratios["cpu"], ratios["wall"]
    print(
        f"\nActivation memory cached / whole: **{memory_ratio:.3f}x** (target <= 0.3). Step "
        f"time cached / whole: CPU **{statistics.median(cpu):.2f}x** [{min(cpu):.2f}-"
        f"{max(cpu):.2f}], wall {statistics.median(wall):.2f}x [{min(wall):.2f}-"
        f"{max(wall):.2f}] (target <= 2.2).\n"
    )
    print(
        f"Side by side, 64 pairs, mini-batch 4, no dropout; float64 whole-batch loss "
        f"{sbs['reference_loss']:.7f}:\n"
    )
    print("| | loss | gradient error vs float64 (relative) | step wall ms | step CPU ms |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("cumulus", "sentence_transformers"):
        if name not in sbs:
            continue
        r = sbs[name]
        label = "cumulus step=cached" if name == "cumulus" else "ST CachedMNRL"
        print(
            f"| {label} | {r['loss']:.7f} | {r['grad_error']:.1e} | {spread(r['wall_ms'])} | "
            f"{spread(r['cpu_ms'])} |"
        )


if __name__ == "__main__":
    main()
