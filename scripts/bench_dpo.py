"""DPO under accumulation and data parallelism: cumulus's `task=dpo` beside TRL's DPOTrainer,
and the time and memory of cumulus's reference modes.

    python scripts/bench_dpo.py [--pairs 16] [--steps 12] [--no-ddp]

1. Step-1 gradient error. The same tiny Llama (2 layers, 32 wide, tests/chat_support.py) and
   the same 16 preference pairs (tests/preference_support.py, as prompt/chosen/rejected
   messages), sigmoid DPO with beta 0.1, fp32 on CPU, at micro x accumulation 16x1, 4x4, 2x8
   and on 2 DDP ranks (torchrun, gloo) 2x4 each. Error: the relative L2 distance of the whole
   step-1 gradient (the one the optimizer is handed, clipping off; TRL with bf16=False,
   its default being bf16 autocast) from the same framework's float64 gradient of the
   whole set at once: TRL's own DPOTrainer with the model in float64
   and one batch of 16; cumulus's DPOTask on the model in float64, one batch of 16. Each
   framework is measured against its own loss on its own tokens; the distance between the
   two float64 gradients says whether they compute the same loss.
2. Reference modes (cumulus): `copy`, `precomputed` and `adapter` (adapter=lora r=16, its
   own policy) on a larger Llama (4 layers, 512 wide, ~13M parameters), micro 4 x
   accumulation 2, each in its own process: the median wall time of steps 3 onward, the
   whole run's wall time (start-up and the precomputed pass included), and the process's
   peak resident memory.

TRL (`pip install trl`, not one of cumulus's dependencies; `pip install --no-deps trl` leaves
torch and transformers as they are) runs when importable; otherwise its column says why not.
Prints a Markdown section and appends it to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.callbacks import Callback  # noqa: E402
from scripts.bench import report  # noqa: E402

BETA = 0.1
SPLITS = [(16, 1), (4, 4), (2, 8)]  # micro x accumulation, one process
DDP = (2, 4)  # per rank, 2 ranks
BIG = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4}
BIG |= {"num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 512}


def rows(n: int) -> list[dict[str, Any]]:
    """tests/preference_support.py's pairs as prompt / chosen / rejected messages (the layout
    both frameworks read)."""
    from tests.preference_support import pair_rows

    out = []
    for r in pair_rows(n, seed=5):
        if "prompt" in r:
            out.append(
                {
                    "prompt": [{"role": "user", "content": r["prompt"]}],
                    "chosen": [{"role": "assistant", "content": r["chosen"]}],
                    "rejected": [{"role": "assistant", "content": r["rejected"]}],
                }
            )
        else:
            out.append(
                {
                    "prompt": r["chosen"][:-1],
                    "chosen": r["chosen"][-1:],
                    "rejected": r["rejected"][-1:],
                }
            )
    return out


def rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    num = sum(float((got[n].double() - w.double()).pow(2).sum()) for n, w in want.items())
    den = sum(float(w.double().pow(2).sum()) for w in want.values())
    return (num / den) ** 0.5


# --------------------------------------------------------------------------- cumulus


def cumulus_args(
    root: Path, micro: int, accum: int, *extra: str, model: str = "pretrained"
) -> list[str]:
    return [
        "model=hf_llama",
        f"model.pretrained={root / model}",
        "data=preference",
        f"data.path={root / 'pairs.jsonl'}",
        f"data.val_path={root / 'val.jsonl'}",
        "data.max_length=256",
        "data.tokenize_workers=1",
        "task=dpo",
        f"task.beta={BETA}",
        "logger=none",
        "optim=sgd",
        "optim.lr=1e-3",
        "optim.momentum=0",
        "scheduler=constant",
        "train.clip_grad_norm=null",
        "train.log_every=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        f"train.micro_batch_size={micro}",
        f"train.grad_accum_steps={accum}",
        *extra,
    ]


def dump(path: Path) -> list[str]:
    return [
        "+callbacks.dump._target_=tests.chat_support.DumpAllGrads",
        f"+callbacks.dump.path={path}",
        "+callbacks.dump.step=1",
        "train.max_steps=1",
    ]


def cumulus_grads(root: Path, micro: int, accum: int, nproc: int = 1) -> dict[str, torch.Tensor]:
    out = root / f"cumulus_{nproc}x{micro}x{accum}"
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    cmd = [*launcher, "-m", "trainer.train", *cumulus_args(root, micro, accum)]
    cmd += [*dump(out.with_suffix(".pt")), f"hydra.run.dir={out}"]
    run(cmd)
    return torch.load(out.with_suffix(".pt"), weights_only=True)


def cumulus_float64(root: Path, n: int) -> dict[str, torch.Tensor]:
    """cumulus's DPO loss over the whole set at once, the model in float64: its own batch of
    its own tokens, DPOTask with a frozen copy of the model as the reference."""
    import transformers

    from engine.preference import DPOTask, frozen_copy
    from tests.conftest import compose_config
    from trainer.config.cli import to_config
    from trainer.run.assemble import build_data

    data, _ = build_data(to_config(compose_config(cumulus_args(root, n, 1)))[0].data)
    assert len(data.train) == n, data.description
    batch = data.collate_fn([data.train[i] for i in range(n)])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        root / "pretrained", dtype=torch.float64
    )
    model.config.use_cache = False
    task = DPOTask(beta=BETA)
    task.attach_reference(frozen_copy(model))
    (task.loss_sum(model, batch) / n).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


# --------------------------------------------------------------------------- TRL


def trl_missing() -> str | None:
    """Why TRL cannot run here, or None."""
    try:
        import trl
        from trl import DPOConfig, DPOTrainer  # noqa: F401
    except Exception as exc:  # (an import error of any kind: the reason is reported)
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    return None if trl else "unknown"


def trl_grads(
    root: Path, micro: int, accum: int, dtype: torch.dtype, bf16: bool = False
) -> dict[str, torch.Tensor]:
    """TRL's step-1 gradient; `bf16`: DPOConfig's default (bf16 autocast, on a CPU too)."""
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    captured: dict[str, dict[str, torch.Tensor]] = {}

    class Grab(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            model = kw["model"]
            model = (
                model.module
                if isinstance(model, torch.nn.parallel.DistributedDataParallel)
                else model
            )
            captured["g"] = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }

    tok = transformers.AutoTokenizer.from_pretrained(root / "pretrained")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "pretrained", dtype=dtype)
    pairs = [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as out:
        cfg = DPOConfig(
            output_dir=out,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accum,
            max_steps=1,
            learning_rate=0.0,
            max_grad_norm=0.0,
            beta=BETA,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            bf16=bf16,
        )
        trainer = DPOTrainer(
            model=model,
            args=cfg,
            train_dataset=Dataset.from_list(pairs),
            processing_class=tok,
            callbacks=[Grab()],
        )
        trainer.train()
    return captured["g"]


def trl_ddp(root: Path) -> dict[str, torch.Tensor]:
    out = root / "trl_ddp.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__]
    run([*cmd, "--trl-worker", str(root), str(out)])
    return torch.load(out, weights_only=True)


# --------------------------------------------------------------------------- reference modes


class StepTimer(Callback):
    """A callback: the wall time at each optimizer step, written after each as JSON to `path`
    with the process's peak resident memory so far."""

    def __init__(self, path: str) -> None:
        self.path, self.times = Path(path), [time.perf_counter()]

    def on_after_optimizer_step(self, ctx: Any, step: int) -> None:
        del ctx, step
        self.times.append(time.perf_counter())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
        self.path.write_text(json.dumps({"times": self.times, "peak_mib": peak}))


def mode_run(root: Path, mode: str, steps: int) -> dict[str, float]:
    extra = ["task.reference=adapter", "adapter=lora", "adapter.r=16"] if mode == "adapter" else []
    extra = extra or [f"task.reference={mode}"]
    out = root / f"mode_{mode}"
    cmd = [sys.executable, "-m", "trainer.train"]
    cmd += cumulus_args(root, 4, 2, *extra, model="big")
    cmd += [f"train.max_steps={steps}", f"hydra.run.dir={out}"]
    cmd += ["+callbacks.timer._target_=scripts.bench_dpo.StepTimer"]
    cmd += [f"+callbacks.timer.path={out}.json"]
    started = time.perf_counter()
    run(cmd)
    whole = time.perf_counter() - started
    got = json.loads(Path(f"{out}.json").read_text())
    t = got["times"]
    return {
        "step_s": statistics.median(b - a for a, b in itertools.pairwise(t[2:])),
        "whole_s": whole,
        "peak_mib": got["peak_mib"],
    }


# --------------------------------------------------------------------------- driver


def run(cmd: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def setup(root: Path, n: int) -> None:
    import transformers

    from tests.chat_support import make_llama, pretrained

    _, tok = pretrained(root)
    with open(root / "pairs.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows(n))
    with open(root / "val.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows(n + 2)[n:])
    big = root / "big"
    tok.save_pretrained(big)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), **BIG)
    transformers.LlamaForCausalLM(config).save_pretrained(big)
    del make_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-ddp", action="store_true")
    parser.add_argument("--trl-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:  # one rank of TRL's 2-rank DDP run (under torchrun)
        root, out = Path(args.trl_worker[0]), Path(args.trl_worker[1])
        grads = trl_grads(root, *DDP, torch.float32)
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(grads, out)
        return
    torch.set_num_threads(1)
    import transformers

    root = Path(tempfile.mkdtemp(prefix="bench-dpo-"))
    setup(root, args.pairs)
    missing = trl_missing()
    want = {"cumulus": cumulus_float64(root, args.pairs)}
    if missing is None:
        want["trl"] = trl_grads(root, args.pairs, 1, torch.float64)
    layouts = [(f"1 process, {m} x {a}", 1, m, a) for m, a in SPLITS]
    if not args.no_ddp:
        layouts.append((f"2 DDP ranks, {DDP[0]} x {DDP[1]} each", 2, *DDP))
    table = []
    for name, nproc, micro, accum in layouts:
        ours = rel_error(cumulus_grads(root, micro, accum, nproc), want["cumulus"])
        if missing is not None:
            theirs = "did not run"
        elif nproc > 1:
            theirs = f"{rel_error(trl_ddp(root), want['trl']):.1e}"
        else:
            theirs = f"{rel_error(trl_grads(root, micro, accum, torch.float32), want['trl']):.1e}"
        table.append(f"| {name} | {ours:.1e} | {theirs} |")
        print(table[-1], flush=True)
    default = (
        f"{rel_error(trl_grads(root, args.pairs, 1, torch.float32, True), want['trl']):.1e}"
        if missing is None
        else "-"
    )
    agree = (
        f"{rel_error(want['trl'], want['cumulus']):.1e}" if missing is None else "(TRL did not run)"
    )
    modes = []
    for mode in ("copy", "precomputed", "adapter"):
        m = mode_run(root, mode, args.steps)
        modes.append(
            f"| {mode} | {m['step_s'] * 1e3:.0f} | {m['whole_s']:.1f} | {m['peak_mib']:.0f} |"
        )
        print(modes[-1], flush=True)
    trl_note = (
        f"TRL {__import__('trl').__version__}"
        if missing is None
        else f"TRL could not run here ({missing})"
    )
    report(
        [
            "",
            "### DPO: step-1 gradient error beside TRL's DPOTrainer, and the reference modes",
            "",
            f"transformers {transformers.__version__}, torch {torch.__version__}, {trl_note}; "
            f"fp32 on CPU, 1 thread. The tiny Llama (2 layers, 32 wide) on {args.pairs} pairs, "
            f"sigmoid DPO, beta {BETA}. Error: relative L2 distance of the step-1 gradient from "
            "the same framework's float64 gradient of the whole set at once. The two float64 "
            f"gradients (TRL's tokens and loss against cumulus's) differ by {agree}. TRL's "
            "DPOConfig defaults to bf16=True (autocast, on a CPU too): the table sets "
            f"bf16=False; at its default the error is {default} at {args.pairs} x 1. Command:",
            "",
            "    python scripts/bench_dpo.py",
            "",
            "| layout (micro x accumulation) | cumulus | TRL DPOTrainer |",
            "|---|---|---|",
            *table,
            "",
            f"Reference modes, cumulus, a 4-layer 512-wide Llama (~13M parameters), micro 4 x "
            f"accumulation 2 (8 pairs a step), {args.steps} steps, one process each; `adapter` "
            "trains LoRA (r=16) adapters, not every weight, so its step is not the same work:",
            "",
            "| task.reference | step (ms, median of steps 3+) | whole run (s) | peak RSS (MiB) |",
            "|---|---|---|---|",
            *modes,
        ],
        str(REPO / "docs" / "benchmarks.md"),
    )


if __name__ == "__main__":
    main()
