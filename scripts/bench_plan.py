"""How long `trainer.plan` takes on this machine, and how close its fast path (2 and 3 blocks
per stage, extrapolated) is to simulating every block (`plan.full=true`).

    python scripts/bench_plan.py [--rounds 1] [--cases 3d,search,moe30b] [--no-full] [--out PATH]

Cases, at Llama-3-8B's shapes (docs/plan.md's `L`): `3d` plans pp 4 x FSDP 4 x tp 4 on 64
GPUs; `search` plans DDP over 8 GPUs with `plan.search=true`. At Qwen3-30B-A3B's (128
experts, top-8, 48 layers, 4096 tokens, global batch 512 on 64 GPUs): `moe30b` plans FSDP2
with dist.ep=8 and searches (`plan.search=true`, dist.ep varied), `moe30b_ep1` the same from
dist.ep=1 (transformers' own expert loop: 128 experts a layer on each rank; off by default,
minutes). Each runs as its own process
(`python -m trainer.plan`), timed in CPU seconds (user + sys of the child: steadier than wall
time on a shared machine) and wall seconds; with `--full` left on, the 3-D plan runs again
with `plan.full=true`, rounds interleaved, and the report compares every role's peak and the
step-time estimate. The report (markdown) goes to `--out` (default: printed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

LLAMA3_8B = [
    "model=hf_llama",
    "model.config.vocab_size=128256",
    "model.config.hidden_size=4096",
    "model.config.intermediate_size=14336",
    "model.config.num_hidden_layers=32",
    "model.config.num_attention_heads=32",
    "model.config.num_key_value_heads=8",
    "model.config.max_position_embeddings=8192",
    "+model.config.rope_theta=500000",
    "data.block_size=8192",
    "train.precision=bf16",
    "train.micro_batch_size=1",
    "logger=none",
]
QWEN3_30B_A3B = [
    "model=hf_qwen3_moe",
    "model.config.vocab_size=151936",
    "model.config.hidden_size=2048",
    "model.config.intermediate_size=6144",
    "model.config.moe_intermediate_size=768",
    "model.config.num_experts=128",
    "model.config.num_experts_per_tok=8",
    "model.config.num_hidden_layers=48",
    "model.config.num_attention_heads=32",
    "model.config.num_key_value_heads=4",
    "model.config.head_dim=128",
    "model.config.max_position_embeddings=4096",
    "data.block_size=4096",
    "train.precision=bf16",
    "train.micro_batch_size=1",
    "train.global_batch_size=512",
    "plan.world=64",
    "dist.strategy=fsdp",
    "logger=none",
]
CASES = {
    "3d": [
        *LLAMA3_8B,
        *("dist.pp=4", "dist.tp=4", "dist.strategy=fsdp"),
        *("train.global_batch_size=16", "plan.world=64"),
    ],
    "search": [
        *LLAMA3_8B,
        *("dist.strategy=ddp", "train.global_batch_size=8", "plan.world=8"),
        "plan.search=true",
    ],
    "moe30b": [*QWEN3_30B_A3B, "dist.ep=8", "plan.search=true"],
    "moe30b_ep1": [*QWEN3_30B_A3B, "dist.ep=1", "plan.search=true"],
}


def run(args: list[str], out: Path) -> tuple[float, float, dict, list[str]]:
    """One `python -m trainer.plan` process: its CPU and wall seconds, plan.json, and the
    seconds between its output lines (the progress lines' spacing)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "trainer.plan", *args, f"plan.out={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    lines, stamps = [], []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        stamps.append(time.perf_counter())
    if proc.wait() != 0:
        raise SystemExit(f"trainer.plan failed: {' '.join(cmd)}")
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    gaps = [b - a for a, b in zip([started, *stamps], stamps)]
    lines.append(f"(longest gap between output lines: {max(gaps, default=0):.1f} s)")
    return cpu, wall, json.loads(out.read_text()), lines


def compare(fast: dict, full: dict) -> list[str]:
    """Every role's peak and the step time, fast over full."""
    rows = []
    for a, b in zip(fast["roles"], full["roles"]):
        span = f"{a['ranks'][0]}-{a['ranks'][-1]}"
        rows.append(
            f"| ranks {span} peak | {a['peak_bytes'] / 2**30:.2f} GiB | "
            f"{b['peak_bytes'] / 2**30:.2f} GiB | {a['peak_bytes'] / b['peak_bytes']:.4f} |"
        )
    ea, eb = fast["estimate"]["step_time_s"], full["estimate"]["step_time_s"]
    rows.append(f"| step time | {ea:.3f} s | {eb:.3f} s | {ea / eb:.4f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cases", default="3d,search")
    parser.add_argument("--no-full", action="store_true", help="skip plan.full=true")
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()
    cases = opts.cases.split(",")
    times: dict[str, list[tuple[float, float]]] = {}
    plans: dict[str, dict] = {}
    shown: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opts.rounds):  # interleaved rounds: fast, full, search
            todo = [(c, CASES[c]) for c in cases]
            if "3d" in cases and not opts.no_full:
                todo.insert(1, ("3d full", [*CASES["3d"], "plan.full=true"]))
            for name, extra in todo:
                cpu, wall, plan, lines = run(extra, Path(tmp) / f"{r}.json")
                times.setdefault(name, []).append((cpu, wall))
                plans[name], shown[name] = plan, lines
    stamp = datetime.date.today().isoformat()
    report = [
        f"## trainer.plan, {stamp} (this machine, torch CPU, load average "
        f"{os.getloadavg()[0]:.1f}, {opts.rounds} round(s), medians)",
        "",
        "`python scripts/bench_plan.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| case | CPU s | wall s | how |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, runs in times.items():
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        report.append(f"| {name} | {cpu:.0f} | {wall:.0f} | {plans[name].get('how', '')} |")
    if "3d" in plans and "3d full" in plans:
        report += ["", "| figure | fast | full | fast / full |", "| --- | ---: | ---: | ---: |"]
        report += compare(plans["3d"], plans["3d full"])
    for name, lines in shown.items():
        report += ["", f"`{name}` output:", "", "```", *lines[-40:], "```"]
    text = "\n".join(report) + "\n"
    if opts.out:
        opts.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
