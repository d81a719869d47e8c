"""GRPO's learning curve on a CPU, from nothing on disk: a tiny model learns two-digit sums
from `exact_answer` alone (docs/guides/rl.md, "A learning curve").

    python scripts/grpo_curve.py OUT [--sft-steps 400] [--grpo-steps 150] [--lr 2e-4]

`sevens` is the sanity check's reward (`reward.funcs.sevens._target_=scripts.grpo_curve.sevens`,
docs/guides/rl.md): learnable from a random in-tree GPT, so a flat curve there is a bug.

Four stages, each a real command of the trainer (printed before it runs) in OUT:

1. data and tokenizer: `what is A + B?` -> `A+B` (A, B in 10..99) as SFT conversations
   (`sft.jsonl`), GRPO prompts with their `answer` (`prompts.jsonl`, `val.jsonl`), and a
   byte-level BPE with ChatML's tokens and a chat template (`tok/`);
2. SFT (`task=causal_lm` on `data=chat`) of the in-tree GPT (0.17M parameters), stopped
   early on purpose: the policy answers in the format and is right only part of the time
   (sampled at temperature 1, about 0.2; greedy about 0.4), which leaves GRPO room to show
   a rise (the earlier recipe's 800 cosine-scheduled steps started it at 0.5 sampled, 0.7
   greedy, and its curve was flat). Its learning rate is constant (3e-3 after 20 warmup
   steps);
3. export (scripts/export_hf.py) as transformers' GPT2LMHeadModel;
4. GRPO (`task=grpo reward=[exact_answer]`, `model=hf_gpt2` on the export, transformers'
   `generate` with its KV cache; 32 prompts x 8 completions a step, Adam at a constant 2e-4,
   no weight decay), then a table of step -> train/reward, val/reward (greedy).

A rerun in the same OUT skips the SFT and the export when their outputs are there (a recipe
killed during GRPO restarts at GRPO).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MODEL = ["model.vocab_size=320", "model.block_size=64", "model.n_layer=3", "model.n_head=4"]
MODEL += ["model.n_embd=64"]


def sevens(prompts: list, completions: list, **row_fields: object) -> list[float]:
    """The sanity check's reward (TRL's signature): the fraction of a completion's
    characters that are '7'. Any policy can learn it; a pipeline that cannot has a bug."""
    del prompts, row_fields
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch == "7" for ch in t) / max(len(t), 1) for t in texts]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_data(out: Path, seed: int = 0) -> None:
    """The sums (SFT, GRPO train and validation prompts: disjoint draws) and the tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)

    def sums(n: int) -> list[tuple[str, str]]:
        pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
        return [(f"what is {a} + {b}?", str(a + b)) for a, b in pairs]

    write_rows(out / "sft.jsonl", [{"prompt": q, "completion": a} for q, a in sums(6000)])
    write_rows(out / "prompts.jsonl", [{"prompt": q, "answer": a} for q, a in sums(1700)])
    write_rows(out / "val.jsonl", [{"prompt": q, "answer": a} for q, a in sums(200)])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["what is the sum user assistant"] * 10, trainer)  # no digits
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out / "tok")


def run(argv: list[str]) -> None:
    cmd = [sys.executable, *argv]
    print("$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def curve(run_dir: Path) -> list[tuple[int, float | None, float | None]]:
    """(step, train/reward, val/reward) from the GRPO run's records."""
    rows: dict[int, list[float | None]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for k, key in enumerate(("train/reward", "val/reward")):
            if key in record:
                rows.setdefault(int(record["step"]), [None, None])[k] = record[key]
    return [(step, *values) for step, values in sorted(rows.items())]  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-4)
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    make_data(out)
    common = ["logger=none", "train.log_every=5"]
    sft = out / "sft"
    sft_args = [
        *("-m", "trainer.train", "model=gpt_tiny", *MODEL, "data=chat"),
        *(f"data.path={out}/sft.jsonl", f"data.tokenizer={out}/tok", "optim.lr=3e-3"),
        *("scheduler=constant", "scheduler.warmup_steps=20"),
        *("train.micro_batch_size=32", f"train.max_steps={args.sft_steps}", "eval.every_steps=0"),
        *(f"checkpoint.every_steps={args.sft_steps}", *common, f"hydra.run.dir={sft}"),
    ]
    if (sft / "checkpoints" / f"step_{args.sft_steps:08d}").is_dir():  # a rerun resumes
        print(f"SFT done already: {sft}", flush=True)
    else:
        run(sft_args)
    if (out / "sft_hf" / "config.json").is_file():
        print(f"export done already: {out}/sft_hf", flush=True)
    else:
        run(["scripts/export_hf.py", f"checkpoint={sft}", f"out={out}/sft_hf"])
    grpo_args = [
        *("-m", "trainer.train", "model=hf_gpt2", f"model.pretrained={out}/sft_hf"),
        *("data=prompts", f"data.path={out}/prompts.jsonl", f"data.val_path={out}/val.jsonl"),
        *("task=grpo", "task.num_generations=8", "task.max_new_tokens=4", "reward=[exact_answer]"),
        *("train.micro_batch_size=16", "train.grad_accum_steps=2", f"optim.lr={args.lr}"),
        *("optim.weight_decay=0.0", "scheduler=constant", f"train.max_steps={args.grpo_steps}"),
        *("eval.every_steps=20", "eval.max_batches=13", "checkpoint.every_steps=0", *common),
        f"hydra.run.dir={out}/grpo",
    ]
    run(grpo_args)
    print("| step | train/reward | val/reward (greedy) |\n| ---: | ---: | ---: |")
    for step, train, val in curve(out / "grpo"):
        cells = ["" if v is None else f"{v:.3f}" for v in (train, val)]
        print(f"| {step} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
