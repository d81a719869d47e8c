"""data=chat is exact: one optimizer step over the whole data set has the float64 full-batch
gradient, the sum of supervised cross-entropy over each conversation run alone divided by
their number, whether the conversations are packed or padded, cut into micro-batches, spread
over 2 DDP or FSDP2 ranks, or split over 2 context-parallel ranks (`dist.cp=2`), also when a
rank and its micro-batches hold no supervised token; and a run killed with -9 reruns bit for
bit.

The reference is computed here with transformers alone (its chat template, its
`return_assistant_tokens_mask`, its model in float64), never with cumulus's data code. Every
run is launched once, all together (`runs`), with a tiny pretrained Llama and a tokenizer
that carries a template. The whole data set is each step's global batch twice over (two
epochs): every conversation counts twice, so the mean is the data set's, and the batch
divides by any number of ranks and micro-batches.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.chat_support import conversations, long_prompts, pretrained, write_jsonl
from tests.conftest import compose_config, read_metrics, train_records
from tests.ranks import explain, launch, launch_all, torchrun_cmd
from tests.test_checkpoint import kill_at, killed
from trainer.config.cli import to_config
from trainer.run.assemble import build_data

transformers = pytest.importorskip("transformers")

MAX_LENGTH = 128
TOL = 1e-5  # relative, fp32 runs against the float64 reference
TIMEOUT = 300.0
DUMP = "tests.chat_support.DumpAllGrads"


def train(args: list[str], run_dir: Path, nproc: int = 1) -> list[str]:
    launcher = torchrun_cmd(nproc) if nproc > 1 else [sys.executable]
    return [*launcher, "-m", "trainer.train", *args, f"hydra.run.dir={run_dir}"]


def data_args(model: Path, train_file: Path, val_file: Path, packed: bool) -> list[str]:
    return [
        "model=hf_llama",
        f"model.pretrained={model}",
        "data=chat",
        f"data.path={train_file}",
        f"data.val_path={val_file}",
        f"data.max_length={MAX_LENGTH}",
        f"data.packed={str(packed).lower()}",
        "data.tokenize_workers=1",
    ]


def rows(args: list[str]) -> int:
    """Training rows of the data these overrides build (and its token cache, made here once
    so that the launched runs only read it)."""
    data, _ = build_data(to_config(compose_config(args))[0].data)
    return len(data.train)


ONE_STEP = [
    "logger=none",
    "optim=sgd",
    "scheduler=constant",
    "train.clip_grad_norm=null",
    "train.max_steps=1",
    "train.log_every=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
]
# The packed run goes on for the kill -9 test: 4 steps, checkpoints at 2 and 4.
FOUR_STEPS = ["train.max_steps=4", "checkpoint.every_steps=2", "optim.lr=0.05"]


def batch(rows_: int, micro: int, ranks: int = 1) -> list[str]:
    """Both epochs of the data in one step: `micro` rows per micro-batch on each rank."""
    accum = 2 * rows_ // (micro * ranks)
    assert accum * micro * ranks == 2 * rows_
    return [f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("chat_exact")
    model, tok = pretrained(root)
    a = write_jsonl(root / "a.jsonl", conversations(24, seed=21, max_turns=2))
    b = write_jsonl(root / "b.jsonl", long_prompts(4))
    val = write_jsonl(root / "val.jsonl", conversations(4, seed=99, max_turns=1))
    packed, padded = data_args(model, a, val, True), data_args(model, a, val, False)
    prompts = data_args(model, b, val, False)
    r_packed, r_padded, r_prompts = rows(packed), rows(padded), rows(prompts)

    def one_step(name: str, args: list[str], nproc: int = 1, *extra: str) -> list[str]:
        dump = [f"+callbacks.dump._target_={DUMP}", f"+callbacks.dump.path={root / name}.pt"]
        return train([*args, *ONE_STEP, *dump, *extra], root / name, nproc)

    # The in-tree GPT on the same rows (its own initial weights: seeded as the trainer seeds).
    gpt = [*packed[2:], "model=gpt_tiny", "model.vocab_size=320", f"model.block_size={MAX_LENGTH}"]
    gpt.append(f"data.tokenizer={model}")
    whole = [*packed, *batch(r_packed, r_packed)]
    cmds = {
        "packed": one_step("packed", whole, 1, *FOUR_STEPS),
        "killed": one_step("killed", whole, 1, *FOUR_STEPS, *kill_at(3, root / "kill.marker")),
        "padded": one_step("padded", [*padded, *batch(r_padded, 2)]),
        "ddp": one_step("ddp", [*packed, *batch(r_packed, 1, 2)], 2),
        "fsdp": one_step("fsdp", [*packed, *batch(r_packed, 1, 2), "dist.strategy=fsdp"], 2),
        "cp": one_step("cp", [*packed, *batch(r_packed, 1), "dist.cp=2"], 2),
        "cp_prompts": one_step("cp_prompts", [*prompts, *batch(r_prompts, 1), "dist.cp=2"], 2),
        "gpt_cp": one_step("gpt_cp", [*gpt, *batch(r_packed, 1), "dist.cp=2"], 2),
    }
    procs = launch_all(cmds, TIMEOUT)
    rerun = launch(cmds["killed"], TIMEOUT)
    return {"root": root, "model": model, "tok": tok, "procs": procs, "rerun": rerun}


# --------------------------------------------------------------------------- the reference


def kept(tok: Any, path: Path) -> list[tuple[list[int], list[int]]]:
    """(ids, supervised mask) of each conversation of `path` that trains: transformers' own
    rendering and assistant mask, at most MAX_LENGTH tokens, at least one target."""
    import json

    out = []
    for line in path.read_text().splitlines():
        messages = json.loads(line)["messages"]
        enc = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = enc["input_ids"], enc["assistant_masks"]
        if len(ids) <= MAX_LENGTH and sum(mask[1:]):
            out.append((ids, mask))
    return out


def reference(
    model_dir: Path, convs: list[tuple[list[int], list[int]]], mean_of_means: bool = False
) -> dict[str, torch.Tensor]:
    """The float64 gradient of the supervised cross-entropy summed over the conversations,
    each run alone, divided by the number of supervised targets (`mean_of_means`: the
    textbook bug instead, each conversation's mean averaged)."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.config.use_cache = False
    total = sum(sum(m[1:]) for _, m in convs)
    for ids, mask in convs:
        x = torch.tensor(ids)[None]
        logits = model(input_ids=x).logits[0, :-1]  # position t predicts token t + 1
        targets = torch.tensor(ids[1:]).masked_fill(torch.tensor(mask[1:]) == 0, -100)
        loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        divisor = sum(mask[1:]) * len(convs) if mean_of_means else total
        (loss / divisor).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def gpt_reference(convs: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """The same float64 gradient for the in-tree GPT of the `gpt_cp` run, each conversation
    alone through its plain causal forward."""
    from trainer.models.gpt import GPT

    torch.manual_seed(1337)  # the trainer's seed, right before it builds the model
    model = GPT(vocab_size=320, block_size=MAX_LENGTH, n_layer=2, n_head=2, n_embd=32).double()
    total = sum(sum(m[1:]) for _, m in convs)
    for ids, mask in convs:
        logits = model(torch.tensor(ids)[None])[0, :-1]
        targets = torch.tensor(ids[1:]).masked_fill(torch.tensor(mask[1:]) == 0, -100)
        (F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / total).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    diff = sum(float((got[n].double() - want[n]).pow(2).sum()) for n in want)
    norm = sum(float(want[n].pow(2).sum()) for n in want)
    return (diff / norm) ** 0.5


@pytest.fixture(scope="module")
def references(runs: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    root, model, tok = runs["root"], runs["model"], runs["tok"]
    a, b = kept(tok, root / "a.jsonl"), kept(tok, root / "b.jsonl")
    assert 15 <= len(a) < 24, "premise: most conversations train, some are too long"
    return {
        "a": reference(model, a),
        "b": reference(model, b),
        "bug": reference(model, a, True),
        "gpt": gpt_reference(a),
    }


# --------------------------------------------------------------------------- the tests


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["packed", "padded", "ddp", "fsdp", "cp"])
def test_one_step_has_the_float64_full_batch_gradient(
    name: str, runs: dict[str, Any], references: dict[str, dict[str, torch.Tensor]]
) -> None:
    proc = runs["procs"][name]
    assert proc.returncode == 0, explain(proc)
    got = torch.load(runs["root"] / f"{name}.pt", weights_only=True)
    error = relative_error(got, references["a"])
    assert error <= TOL, (name, error)
    # The tolerance means something: the per-conversation mean is far outside it.
    assert relative_error(references["bug"], references["a"]) > 100 * TOL


@pytest.mark.multiproc
def test_the_in_tree_gpt_under_context_parallelism(
    runs: dict[str, Any], references: dict[str, dict[str, torch.Tensor]]
) -> None:
    """gpt_tiny, packed conversations split over 2 context-parallel ranks: the documents of
    the whole sequence gathered once per forward, attention masked by document."""
    proc = runs["procs"]["gpt_cp"]
    assert proc.returncode == 0, explain(proc)
    got = torch.load(runs["root"] / "gpt_cp.pt", weights_only=True)
    assert relative_error(got, references["gpt"]) <= TOL


@pytest.mark.multiproc
def test_a_context_parallel_rank_without_supervised_tokens(
    runs: dict[str, Any], references: dict[str, dict[str, torch.Tensor]]
) -> None:
    """dist.cp=2 on conversations whose supervised tokens all sit in their last quarter: rank
    1 holds chunks 1 and 2 of 4 of each, so every micro-batch of that rank has no supervised
    token. The step still has the full-batch gradient."""
    from engine.parallel.context import SequenceShard

    proc = runs["procs"]["cp_prompts"]
    assert proc.returncode == 0, explain(proc)
    data, _ = build_data(
        to_config(
            compose_config(
                data_args(
                    runs["model"], runs["root"] / "b.jsonl", runs["root"] / "val.jsonl", False
                )
            )
        )[0].data
    )
    held = [0, 0]
    for i in range(len(data.train)):
        labels = data.collate_fn([data.train[i]])["shift_labels"]
        for rank in (0, 1):
            held[rank] += int((SequenceShard(2, rank, None).split(labels, -100) != -100).sum())
    assert held[0] > 0 and held[1] == 0, held
    got = torch.load(runs["root"] / "cp_prompts.pt", weights_only=True)
    assert relative_error(got, references["b"]) <= TOL


@pytest.mark.multiproc
def test_killed_run_reruns_bit_for_bit(runs: dict[str, Any]) -> None:
    procs, root = runs["procs"], runs["root"]
    assert procs["packed"].returncode == 0, explain(procs["packed"])
    assert killed(procs["killed"]), explain(procs["killed"])
    assert runs["rerun"].returncode == 0, explain(runs["rerun"])
    assert "resumed from" in runs["rerun"].stdout, explain(runs["rerun"])
    ref = {r["step"]: r["train/loss"] for r in train_records(read_metrics(root / "packed"))}
    got = {r["step"]: r["train/loss"] for r in train_records(read_metrics(root / "killed"))}
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4]
    assert got == ref
    assert ref[4] < ref[1], ref
