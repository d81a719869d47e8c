"""GRPO beside TRL's GRPOTrainer: step time and generation's share of it, and each one's
step-1 gradient error against the float64 whole-batch objective, per loss type.

    python scripts/bench_grpo.py [--steps 8] [--repeats 3] [--no-ddp] [--losses dapo,grpo,dr_grpo]

The model: tests/chat_support.py's tiny Llama (2 layers, 32 wide, random init) and its
tokenizer, with the end token's output row scaled by EOS_GAIN so that a random policy ends its
completions at varied lengths (1 to L_MAX tokens; at random init it never would, and every
normalization would agree). The prompts: tests/prompts_support.py's sums, each one user
message. The reward (both frameworks, TRL's signature): the fraction of a completion's token
ids that are even, read from `completion_ids` (no decoding, so both score the same tokens
alike). G = 4 completions per prompt, 8 prompts a step, at most L_MAX = 8 new tokens,
temperature 1, fp32 on CPU, 1 thread.

1. Gradient error. cumulus's real trainer (`task=grpo`, SGD, clipping off) generates step 1's
   rollouts and captures the gradient handed to the optimizer (tests/grpo_run_support.py's
   `CaptureSteps`); cumulus's rollouts do not depend on the layout, so every cumulus layout
   trains on the same tokens. TRL's GRPOTrainer is fed those very rollouts through its
   `rollout_func` argument (the prompt and completion token ids; TRL scores them with the same
   reward, computes its own advantages and loss), and its gradient is captured at
   `on_pre_optimizer_step` (`max_grad_norm=0`, learning rate 0). Layouts: 32 completions as
   micro x accumulation 32x1, 8x4, 4x8 (cumulus counts prompts: 8x1, 2x4, 1x8) and 2 DDP
   ranks (torchrun, gloo) of 8x2 each. The reference is computed here, from the definitions
   (DeepSeekMath's GRPO, DAPO arXiv 2503.14476, Dr. GRPO arXiv 2503.20783): a float64 copy of
   the model scores each completion alone (its prompt, its tokens, no padding), the
   advantages are (r - mean_g) / (std_g + 1e-4) (Bessel std, both frameworks' definition),
   and the batch's loss is Σ l / Σ|o_i| (dapo), (1/N) Σ_i (1/|o_i|) Σ_t l (grpo) or
   Σ l / (N L_max) (dr_grpo). Error: the relative L2 distance of the whole gradient. TRL runs
   with bf16=False (its GRPOConfig defaults to bf16=True, autocast on a CPU too); its default
   is measured once at 32x1. TRL's `bnpo` (no cumulus counterpart) is measured against the
   dapo objective, the exact form of a token mean.
2. Step time. Each framework trains `--steps` steps generating its own rollouts (lr 1e-6
   AdamW, both), in its own process, alternating (cumulus, TRL, cumulus, TRL...); a run's step
   time is the median of its steps 3 onward, generation's share its generation time over its
   step time (cumulus: `time/generate_s`; TRL: the time spent in its `_generate_single_turn`,
   measured by a subclass), and the table gives the median over the runs.

TRL (`pip install trl`, the `bench` extra, not one of cumulus's dependencies) runs when
importable; otherwise its column says why not. Writes OUT/bench_grpo.json, prints a Markdown
section and appends it to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
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

from scripts.bench import report  # noqa: E402

G, PROMPTS, L_MAX, EPS = 4, 8, 8, 0.2
EOS_GAIN = 60.0
SPLITS = [(8, 1), (2, 4), (1, 8)]  # prompts per micro-batch x accumulation, one process
DDP = (2, 2)  # per rank, 2 ranks
LOSSES = ("dapo", "grpo", "dr_grpo")


def even_ids(prompts: list, completions: list, completion_ids: list, **row: Any) -> list[float]:
    """The reward (TRL's signature): the fraction of the completion's token ids that are
    even."""
    del prompts, completions, row
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:6]
    num = sum(float((got[n].double() - w).pow(2).sum()) for n, w in want.items())
    den = sum(float(w.pow(2).sum()) for w in want.values())
    return (num / den) ** 0.5


# --------------------------------------------------------------------------- setup


def setup(root: Path, timing_prompts: int) -> None:
    """The model (its end token's row scaled), the tokenizer, the prompts files."""
    import transformers

    from tests.chat_support import pretrained
    from tests.prompts_support import prompt_rows

    path, tok = pretrained(root)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= EOS_GAIN
    model.save_pretrained(path)

    def write(name: str, rows: list[dict[str, Any]]) -> None:
        with open(root / name, "w") as fh:
            for r in rows:
                question = r["prompt"] if isinstance(r["prompt"], str) else r["prompt"][-1]
                question = question if isinstance(question, str) else question["content"]
                fh.write(json.dumps({"prompt": [{"role": "user", "content": question}]}) + "\n")

    rows = prompt_rows(PROMPTS + 2 + timing_prompts, seed=3)
    write("prompts.jsonl", rows[:PROMPTS])
    write("val.jsonl", rows[PROMPTS : PROMPTS + 2])
    write("timing.jsonl", rows[PROMPTS + 2 :])


# --------------------------------------------------------------------------- cumulus


def cumulus_args(root: Path, loss: str, micro: int, accum: int, data: str) -> list[str]:
    return [
        "model=hf_llama",
        f"model.pretrained={root / 'pretrained'}",
        "data=prompts",
        f"data.path={root / data}",
        f"data.val_path={root / 'val.jsonl'}",
        "data.tokenize_workers=1",
        f"data.cache_dir={root / 'cache'}",
        "task=grpo",
        f"task.loss_type={loss}",
        f"task.num_generations={G}",
        f"task.max_new_tokens={L_MAX}",
        f"task.epsilon={EPS}",
        "reward=none",
        "+reward.funcs.even._target_=scripts.bench_grpo.even_ids",
        "logger=none",
        "train.log_every=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        f"train.micro_batch_size={micro}",
        f"train.grad_accum_steps={accum}",
    ]


def cumulus_grads(root: Path, loss: str, micro: int, accum: int, nproc: int = 1) -> Path:
    """One SGD step of the real trainer; the capture (parameters, gradient, rollouts)."""
    out = root / f"cumulus_{loss}_{nproc}x{micro}x{accum}"
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd = [
        *launcher,
        "-m",
        "trainer.train",
        *cumulus_args(root, loss, micro, accum, "prompts.jsonl"),
    ]
    cmd += ["optim=sgd", "optim.lr=1e-3", "optim.momentum=0", "scheduler=constant"]
    cmd += ["train.clip_grad_norm=null", "train.max_steps=1", f"hydra.run.dir={out}"]
    cmd += ["+callbacks.capture._target_=tests.grpo_run_support.CaptureSteps"]
    cmd += [f"+callbacks.capture.out={out}"]
    run(cmd)
    return out / "step1.pt"


def rollouts_of(capture: Path) -> list[dict[str, Any]]:
    """The captured groups as plain token lists: prompt, completions, rewards."""
    groups = torch.load(capture, weights_only=False)["groups"]
    return [
        {
            "prompt": g["prompt"].tolist(),
            "completions": [
                g["completions"][i, : int(g["lengths"][i])].tolist()
                for i in range(len(g["lengths"]))
            ],
        }
        for g in groups
    ]


def captured_grads(capture: Path) -> dict[str, torch.Tensor]:
    grads = torch.load(capture, weights_only=False)["grads"]
    return {strip(n): g for n, g in grads.items()}


def strip(name: str) -> str:
    """A parameter's name as transformers' model names it (cumulus's wrapper adds a prefix)."""
    for prefix in ("module.", "_orig_mod.", "hf."):
        name = name.removeprefix(prefix)
    return name


# --------------------------------------------------------------------------- the reference


def reference(root: Path, rollouts: list[dict[str, Any]], loss: str) -> dict[str, torch.Tensor]:
    """The float64 gradient of the batch's objective, from the definitions (module docstring)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        root / "pretrained", dtype=torch.float64
    )
    terms, tokens, n = [], 0, 0
    for group in rollouts:
        rewards = even_ids([], [], group["completions"])
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5
        for ids, r in zip(group["completions"], rewards):
            a = (r - mean) / (std + 1e-4)
            row = torch.tensor([group["prompt"] + ids])
            p = len(group["prompt"])
            logp = model(row).logits[0].log_softmax(-1)[p - 1 : p - 1 + len(ids)]
            lp = logp.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
            ratio = torch.exp(lp - lp.detach())
            per_token = -torch.minimum(ratio * a, ratio.clamp(1 - EPS, 1 + EPS) * a)
            terms.append(per_token.sum() / (len(ids) if loss == "grpo" else 1))
            tokens, n = tokens + len(ids), n + 1
    denominator = {"dapo": tokens, "grpo": n, "dr_grpo": n * L_MAX}[loss]
    (torch.stack(terms).sum() / denominator).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


# --------------------------------------------------------------------------- TRL


def trl_missing() -> str | None:
    """Why TRL cannot run here, or None."""
    try:
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except Exception as exc:  # (an import error of any kind: the reason is reported)
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    return None


def trl_config(out: str, micro: int, accum: int, loss: str, **more: Any) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        num_generations=G,
        max_completion_length=L_MAX,
        loss_type=loss,
        epsilon=EPS,
        temperature=1.0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **more,
    )


def fixed_rollouts(rollouts: list[dict[str, Any]]) -> Any:
    """TRL's `rollout_func`: each prompt's G completions as cumulus generated them, in order
    (a call holds whole groups: TRL's sampler repeats a prompt G times in a row)."""
    by_text: dict[str, dict[str, Any]] = {}

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        if not by_text:
            for group in rollouts:
                by_text[tok.decode(group["prompt"])] = group
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for messages in prompts:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            group = by_text[text]
            k = seen[text] = seen.get(text, -1) + 1
            prompt_ids.append(group["prompt"])
            completion_ids.append(group["completions"][k])
        assert all(v == G - 1 for v in seen.values()), seen  # whole groups
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout_func


def trl_grads(
    root: Path,
    rollouts: list[dict[str, Any]],
    loss: str,
    micro: int,
    accum: int,
    dtype: torch.dtype = torch.float32,
    bf16: bool = False,
) -> dict[str, torch.Tensor]:
    """TRL's step-1 gradient on the fixed rollouts (`micro` completions per micro-batch)."""
    import transformers
    from datasets import Dataset
    from trl import GRPOTrainer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    captured: dict[str, dict[str, torch.Tensor]] = {}

    class Grab(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            model = kw["model"]
            model = model.module if hasattr(model, "module") else model
            captured["g"] = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }

    tok = transformers.AutoTokenizer.from_pretrained(root / "pretrained")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "pretrained", dtype=dtype)
    rows = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as out:
        cfg = trl_config(
            out, micro, accum, loss, max_steps=1, learning_rate=0.0, max_grad_norm=0.0, bf16=bf16
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=even_ids,
            args=cfg,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            rollout_func=fixed_rollouts(rollouts),
            callbacks=[Grab()],
        )
        trainer.train()
    return captured["g"]


def trl_ddp(root: Path, capture: Path, loss: str) -> dict[str, torch.Tensor]:
    out = root / f"trl_ddp_{loss}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__]
    run([*cmd, "--trl-worker", str(root), str(capture), loss, str(out)])
    return torch.load(out, weights_only=True)


def trl_timed(root: Path, steps: int, out: Path) -> None:
    """TRL training `steps` steps on its own rollouts: each step's end time and the time
    spent generating, to `out` (JSON)."""
    import transformers
    from datasets import Dataset
    from trl import GRPOTrainer

    generate_s: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                generate_s.append(time.perf_counter() - start)

    ends = [time.perf_counter()]

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

    tok = transformers.AutoTokenizer.from_pretrained(root / "pretrained")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "pretrained")
    rows = [json.loads(line) for line in (root / "timing.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = trl_config(tmp, PROMPTS * G, 1, "dapo", max_steps=steps, bf16=False)
        cfg.learning_rate, cfg.weight_decay = 1e-6, 0.0
        trainer = Timed(
            model=model,
            reward_funcs=even_ids,
            args=cfg,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[Clock()],
        )
        ends[0] = time.perf_counter()
        trainer.train()
    out.write_text(json.dumps({"ends": ends, "generate_s": generate_s}))


# --------------------------------------------------------------------------- timing


def time_cumulus(root: Path, steps: int, k: int) -> tuple[float, float]:
    out = root / f"time_cumulus_{k}"
    cmd = [sys.executable, "-m", "trainer.train"]
    cmd += cumulus_args(root, "dapo", PROMPTS, 1, "timing.jsonl")
    cmd += ["optim.lr=1e-6", "optim.weight_decay=0.0", "scheduler=constant"]
    cmd += [f"train.max_steps={steps}", f"hydra.run.dir={out}"]
    cmd += ["+callbacks.timer._target_=scripts.bench_dpo.StepTimer"]
    cmd += [f"+callbacks.timer.path={out}.json"]
    run(cmd)
    t = json.loads(Path(f"{out}.json").read_text())["times"]
    gen = [
        r["time/generate_s"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "time/generate_s" in r
    ]
    step = statistics.median(b - a for a, b in itertools.pairwise(t[2:]))
    return step, statistics.median(gen[2:]) / step


def time_trl(root: Path, steps: int, k: int) -> tuple[float, float]:
    out = root / f"time_trl_{k}.json"
    run([sys.executable, __file__, "--trl-time", str(root), str(steps), str(out)])
    got = json.loads(out.read_text())
    step = statistics.median(b - a for a, b in itertools.pairwise(got["ends"][2:]))
    return step, statistics.median(got["generate_s"][2:]) / step


# --------------------------------------------------------------------------- driver


def run(cmd: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["TRL_EXPERIMENTAL_SILENCE"] = "1"
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def workers(argv: list[str]) -> bool:
    """The subprocess entry points (a TRL DDP rank, a TRL timing run)."""
    if argv[:1] == ["--trl-worker"]:
        root, capture, loss, out = Path(argv[1]), Path(argv[2]), argv[3], Path(argv[4])
        micro, accum = DDP[0] * G, DDP[1]
        grads = trl_grads(root, rollouts_of(capture), loss, micro, accum)
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(grads, out)
        return True
    if argv[:1] == ["--trl-time"]:
        torch.set_num_threads(1)
        trl_timed(Path(argv[1]), int(argv[2]), Path(argv[3]))
        return True
    return False


def gradient_table(root: Path, losses: list[str], ddp: bool, trl: bool) -> dict[str, Any]:
    """Per loss type and layout: cumulus's and TRL's error against the float64 objective."""
    layouts = [(f"1 process, {m * G} x {a}", 1, m, a) for m, a in SPLITS]
    if ddp:
        layouts.append((f"2 DDP ranks, {DDP[0] * G} x {DDP[1]} each", 2, *DDP))
    results: dict[str, Any] = {}
    for loss in losses:
        base = cumulus_grads(root, loss, *SPLITS[0])
        rollouts = rollouts_of(base)
        want = reference(root, rollouts, loss)
        rows: dict[str, Any] = {}
        for name, nproc, micro, accum in layouts:
            capture = base if (nproc, micro, accum) == (1, *SPLITS[0]) else None
            capture = capture or cumulus_grads(root, loss, micro, accum, nproc)
            assert rollouts_of(capture) == rollouts, f"{name}: other rollouts"
            ours = rel_error(captured_grads(capture), want)
            theirs = None
            if trl:
                got = (
                    trl_ddp(root, base, loss)
                    if nproc > 1
                    else trl_grads(root, rollouts, loss, micro * G, accum)
                )
                theirs = rel_error(got, want)
            rows[name] = {"cumulus": ours, "trl": theirs}
            print(loss, name, rows[name], flush=True)
        if trl:
            rows["trl_float64"] = rel_error(
                trl_grads(root, rollouts, loss, PROMPTS * G, 1, torch.float64), want
            )
            rows["trl_bf16_default"] = rel_error(
                trl_grads(root, rollouts, loss, PROMPTS * G, 1, bf16=True), want
            )
        if loss == "dapo":
            lengths = [len(c) for g in rollouts for c in g["completions"]]
            results["lengths"] = {"min": min(lengths), "max": max(lengths), "n": len(lengths)}
            if trl:  # TRL's bnpo against the dapo objective (a token mean, its exact form)
                bnpo = {}
                for name, nproc, micro, accum in layouts:
                    got = (
                        trl_ddp(root, base, "bnpo")
                        if nproc > 1
                        else trl_grads(root, rollouts, "bnpo", micro * G, accum)
                    )
                    bnpo[name] = rel_error(got, want)
                    print("bnpo", name, bnpo[name], flush=True)
                results["trl_bnpo_vs_dapo"] = bnpo
        results[loss] = rows
    return results


def markdown(results: dict[str, Any], timing: dict[str, Any], args: Any, commit: str) -> list[str]:
    import transformers

    trl_note = "TRL did not run"
    if results.get("trl_version"):
        trl_note = f"TRL {results['trl_version']}"
    fmt = lambda v: "did not run" if v is None else f"{v:.1e}"  # noqa: E731
    grad_rows = []
    for loss in args.losses:
        for name, r in results[loss].items():
            if isinstance(r, dict):
                grad_rows.append(f"| {loss} | {name} | {fmt(r['cumulus'])} | {fmt(r['trl'])} |")
    if "trl_bnpo_vs_dapo" in results:
        for name, v in results["trl_bnpo_vs_dapo"].items():
            grad_rows.append(f"| TRL `bnpo` (against dapo's objective) | {name} | - | {fmt(v)} |")
    extras = [
        f"{loss}: {fmt(results[loss].get('trl_float64'))} (float64), "
        f"{fmt(results[loss].get('trl_bf16_default'))} (bf16 default)"
        for loss in args.losses
    ]
    lengths = results["lengths"]
    time_rows = [
        f"| {name} | {statistics.median(t['step_s']) * 1e3:.0f} | "
        f"{statistics.median(t['generate_share']) * 100:.0f}% | "
        + ", ".join(f"{s * 1e3:.0f}" for s in t["step_s"])
        + " |"
        for name, t in timing.items()
    ]
    return [
        "",
        "## GRPO beside TRL",
        "",
        f"`python scripts/bench_grpo.py`, commit {commit}, this project's 2-core CPU shared with "
        f"other jobs, 1 thread; transformers {transformers.__version__}, torch "
        f"{torch.__version__}, {trl_note}, fp32. The tiny Llama of tests/chat_support.py "
        f"(random init, its end token's output row x{EOS_GAIN:g} so that completions end at "
        f"{lengths['min']} to {lengths['max']} tokens), {PROMPTS} prompts x G={G} per step, "
        f"at most {L_MAX} new tokens, temperature 1, the reward the fraction of even token "
        "ids (TRL's signature, one function for both). How each is measured is in the "
        "script's docstring.",
        "",
        "Step-1 gradient against the float64 gradient of the whole batch's objective written "
        "from the papers (relative L2). Both train on the same rollouts: cumulus's trainer "
        "generates them (the same tokens on every layout), TRL's GRPOTrainer is handed them "
        "through `rollout_func` and scores them itself. Completions per micro-batch x "
        "accumulation:",
        "",
        "| loss type | layout | cumulus | TRL GRPOTrainer |",
        "|---|---|---|---|",
        *grad_rows,
        "",
        "TRL at 32 x 1 in float64, and at its default bf16=True (autocast, on a CPU too): "
        + "; ".join(extras)
        + ".",
        "",
        f"Step time ({args.steps} steps, each framework generating its own rollouts, dapo, "
        f"32 completions in one micro-batch, median of steps 3 onward per run, {args.repeats} "
        "runs each, alternating; generation's share: the median over the runs):",
        "",
        "| framework | step (ms, median) | generation's share | each run (ms) |",
        "|---|---|---|---|",
        *time_rows,
    ]


def main() -> None:
    if workers(sys.argv[1:]):
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-ddp", action="store_true")
    parser.add_argument("--no-append", action="store_true", help="print, do not append")
    parser.add_argument("--losses", type=lambda s: s.split(","), default=list(LOSSES))
    parser.add_argument("--out", type=Path, default=None, help="where bench_grpo.json goes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    setup(root, PROMPTS * args.steps)
    missing = trl_missing()
    results = gradient_table(root, args.losses, not args.no_ddp, missing is None)
    results["trl_version"] = None if missing else __import__("trl").__version__
    results["trl_missing"] = missing
    timing: dict[str, Any] = {"cumulus": {"step_s": [], "generate_share": []}}
    if missing is None:
        timing["TRL GRPOTrainer"] = {"step_s": [], "generate_share": []}
    for k in range(args.repeats):
        for name, timer in (("cumulus", time_cumulus), ("TRL GRPOTrainer", time_trl)):
            if name in timing:
                step, share = timer(root, args.steps, k)
                timing[name]["step_s"].append(step)
                timing[name]["generate_share"].append(share)
                print(name, f"{step * 1e3:.0f} ms, generation {share:.0%}", flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    out = args.out or root
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_grpo.json").write_text(
        json.dumps({"commit": commit, "gradients": results, "timing": timing}, indent=1)
    )
    lines = markdown(results, timing, args, commit)
    if args.no_append:
        print("\n".join(lines))
    else:
        report(lines, str(REPO / "docs" / "benchmarks.md"))
    print(f"wrote {out / 'bench_grpo.json'}")


if __name__ == "__main__":
    main()
