"""task=dpo on data=preference is exact: the second SGD step's gradient (the policy moved by the
first, the reference still the initial model) equals the float64 gradient of the loss over the
whole set of pairs, for sigmoid DPO (with label smoothing) on one process as one micro-batch,
as 4 micro-batches of 2 pairs (padded, and packed: each pair one row, its sides two documents),
on 2 DDP and 2 FSDP2 ranks (also under LoRA), on 2 FSDP2 ranks with task.reference=precomputed
(the initial model's log-probabilities written before training, scored by the sharded model,
each rank its share: one process writes the same bits; a second start reads them, another base
writes its own; a run killed with -9 reruns bit for bit reading them back; on 2 tensor-parallel
ranks each chunk scored by both, its own key), and for ipo, simpo, hinge and robust (TRL's
definitions, one class each in engine/preference_losses.py) against their own
references; the records `train/reward_*` and `val/*` equal the reference's means over the
pairs. Under LoRA the reference is the base with the adapters disabled; a resumed run repeats
the uninterrupted one, and exports (scripts/export_hf.py) as the trained policy. Composition:
micro_batch_size=auto counts whole pairs and a redone window records once, trainer.certify and
trainer.plan take DPO runs, trainer.preview shows pairs; under fp8 the copy is of the converted
policy (step 1 cancels), and the precomputed key names the bf16 parameters FSDP2 computes with.
Bad input: rows without a side, with content that is not text or whose prompts differ are one
paragraph naming each FILE:LINE (data.bad_rows=drop: dropped and counted by kind), a set with
no pair is one paragraph counting every row of the file, task.reference=adapter without an
adapter names the key, CUDA graphs on pairs are refused before any model is built.
Memory: the runs take each token's log-probability 32 tokens at a time, from the GPT's hidden
states (its logits never held) or, for the whole batch and ipo, from its logits; at a real
vocabulary (32768) both equal the whole fp32 log-softmax (task.chunk_size=null) to round-off
with a measured peak lower by more than two (from the hidden states) or one (from fp32 logits)
fp32 (rows, T, V) tensors; the two functions (engine/numerics/chunked_ce.py) equal the float64
log-softmax and its gradients under per-token weights.

The reference is computed here: transformers renders and tokenizes each side (its chat
template with generation markers; the answer is the marked tokens after the prompt rendered
with its generation prompt), the in-tree GPT in float64 scores each side alone, and the DPO
losses are written out from their papers' formulas (ipo on length-normalized log-probabilities,
as TRL's DPOTrainer; simpo as TRL's CPOTrainer). The step-2 gradient is the one that sees the
reference: at step 1 the policy is the reference and every log-ratio is 0.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.chat_support import make_tokenizer, write_jsonl
from tests.conftest import compose_config, read_metrics, train_in_process, train_records
from tests.preference_support import pair_rows
from tests.ranks import explain, launch, launch_all, torchrun_cmd
from tests.test_checkpoint import kill_at, killed
from trainer.config.cli import to_config
from trainer.config.errors import UserError
from trainer.run.assemble import build_data

transformers = pytest.importorskip("transformers")
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao (the extra fp8) not installed"
)

MAX_LENGTH = 256  # the pairs packed fit whole
PAIRS = 8
LR = 2.0
TOL = 1e-5  # relative, fp32 runs against the float64 reference
BIG_VOCAB = 32768  # a real vocabulary's size (task.chunked_vocab_threshold's default)
TIMEOUT = 300.0
DUMP = "tests.chat_support.DumpAllGrads"
SHARDED_ONLY = "tests.preference_support.ShardedOnlyGPT"
# (loss_type, beta, label_smoothing, gamma) of each run's task.
LOSSES = {"sigmoid": ("sigmoid", 0.5, 0.1, 0.0), "ipo": ("ipo", 0.5, 0.0, 0.0)}
LOSSES["simpo"] = ("simpo", 2.0, 0.0, 0.5)
LOSSES["hinge"] = ("hinge", 0.5, 0.0, 0.0)  # TRL's hinge
LOSSES["robust"] = ("robust", 0.5, 0.2, 0.0)  # TRL's robust


def data_args(root: Path, train_file: Path, val_file: Path | None = None) -> list[str]:
    return [
        "model=gpt_tiny",
        "model.vocab_size=320",
        f"model.block_size={MAX_LENGTH}",
        "data=preference",
        f"data.path={train_file}",
        *([f"data.val_path={val_file}"] if val_file else []),
        f"data.tokenizer={root / 'tok'}",
        f"data.max_length={MAX_LENGTH}",
        "data.tokenize_workers=1",
    ]


# How the log-probabilities are computed (engine/numerics/chunked_ce.py), 32 tokens at a time
# (several chunks of every micro-batch): `head` from the in-tree GPT's hidden states (its
# 320 classes over the threshold: the logits never held), `logits` from its logits.
ROUTES = {
    "head": ["task.chunk_size=32", "task.chunked_vocab_threshold=256"],
    "logits": ["task.chunk_size=32", "task.chunked_vocab_threshold=1024"],
}


def task_args(name: str, route: str | None = "head") -> list[str]:
    """`route` None: the task's own chunking (task.chunk_size=auto, its threshold)."""
    loss_type, beta, eps, gamma = LOSSES[name]
    return [
        "task=dpo",
        f"task.loss_type={loss_type}",
        f"task.beta={beta}",
        f"task.label_smoothing={eps}",
        f"task.gamma={gamma}",
        *(ROUTES[route] if route else []),
    ]


TWO_STEPS = [
    "logger=none",
    "optim=sgd",
    f"optim.lr={LR}",
    "optim.momentum=0",
    "scheduler=constant",
    "train.clip_grad_norm=null",
    "train.max_steps=2",
    "train.log_every=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
]


LORA = ["adapter=lora", "adapter.r=4", "adapter.alpha=8"]
PRECOMPUTED_FOUR = ["task.reference=precomputed", "train.max_steps=4", "checkpoint.every_steps=2"]


def batch(micro: int, ranks: int = 1) -> list[str]:
    """All the pairs in each step: `micro` pairs per micro-batch on each rank."""
    accum = PAIRS // (micro * ranks)
    assert accum * micro * ranks == PAIRS
    return [f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dpo")
    tok = make_tokenizer(root / "tok")
    train_file = write_jsonl(root / "pairs.jsonl", pair_rows(PAIRS, seed=5))
    val_file = write_jsonl(root / "val.jsonl", pair_rows(2, seed=6))
    args = data_args(root, train_file, val_file)
    data, _ = build_data(to_config(compose_config(args))[0].data)  # the token cache, once
    assert len(data.train) == PAIRS, data.description

    def two_steps(
        name: str,
        loss: str,
        split: list[str],
        nproc: int = 1,
        *extra: str,
        route: str | None = "head",
    ) -> list[str]:
        dump = [f"+callbacks.dump._target_={DUMP}", f"+callbacks.dump.path={root / name}.pt"]
        launcher = torchrun_cmd(nproc) if nproc > 1 else [sys.executable]
        return [
            *launcher,
            "-m",
            "trainer.train",
            *(big_vocab if name.startswith("big_") else args),
            *task_args(loss, route),
            *TWO_STEPS,
            *split,
            *dump,
            "+callbacks.dump.step=2",
            *extra,
            f"hydra.run.dir={root / name}",
        ]

    # The in-tree GPT at a real vocabulary (gpt_tiny otherwise): the log-probabilities from
    # its hidden states, from its logits, and as the whole fp32 log-softmax of its logits.
    big_vocab = [
        a if a != "model.vocab_size=320" else f"model.vocab_size={BIG_VOCAB}" for a in args
    ]
    big = [*batch(2), "train.memory_report=true"]
    cmds = {
        # The whole run also evaluates after its last step (val/*, and a text sample from the
        # chosen side's prompt). Its log-probabilities, and ipo's, come from the logits.
        "whole": two_steps(
            "whole", "sigmoid", batch(PAIRS), 1, "eval.every_steps=2", route="logits"
        ),
        # (Each reference mode's memory measured: MEASURED.)
        "accum": two_steps("accum", "sigmoid", batch(2), 1, "train.memory_report=true"),
        "ddp": two_steps("ddp", "sigmoid", batch(2, 2), 2),
        # FSDP2: the policy sharded, the reference a whole frozen copy on each rank.
        "fsdp": two_steps("fsdp", "sigmoid", batch(2, 2), 2, "dist.strategy=fsdp"),
        "ipo": two_steps("ipo", "ipo", batch(2), route="logits"),
        "simpo": two_steps("simpo", "simpo", batch(2), 1, "train.memory_report=true"),
        "hinge": two_steps("hinge", "hinge", batch(2)),
        "robust": two_steps("robust", "robust", batch(2)),
        "packed": two_steps("packed", "sigmoid", batch(2), 1, "data.packed=true"),
        # LoRA: the base with its adapters disabled (the default), and a frozen copy.
        "lora_adapter": two_steps(
            "lora_adapter", "sigmoid", batch(2), 1, *LORA, "train.memory_report=true"
        ),
        "lora_copy": two_steps("lora_copy", "sigmoid", batch(2), 1, *LORA, "task.reference=copy"),
        # LoRA under FSDP2: the base sharded, the reference its adapters disabled.
        "lora_fsdp": two_steps("lora_fsdp", "sigmoid", batch(2, 2), 2, *LORA, "dist.strategy=fsdp"),
        # The initial model's log-probabilities written before training, each rank its share,
        # on 2 FSDP2 ranks by a model that fits only sharded (a whole one runs out of memory).
        "precomputed": two_steps(
            "precomputed",
            "sigmoid",
            batch(2, 2),
            2,
            "task.reference=precomputed",
            "eval.every_steps=2",
            "dist.strategy=fsdp",
            f"model._target_={SHARDED_ONLY}",
            "train.memory_report=true",
        ),
        # The same pass on 2 tensor-parallel ranks (dp 1): the pair of ranks scores each chunk
        # together through the split layers.
        "tp_precomputed": two_steps(
            "tp_precomputed", "sigmoid", batch(2), 2, "task.reference=precomputed", "dist.tp=2"
        ),
        # Precomputed, 4 steps with checkpoints at 2 and 4: uninterrupted, and killed (-9) at
        # step 3 then started again.
        # (Micro-batches of 4: a key of their own, the 2-rank run above computes its values.)
        "four": two_steps("four", "sigmoid", batch(4), 1, *PRECOMPUTED_FOUR),
        "killed": two_steps(
            "killed", "sigmoid", batch(4), 1, *PRECOMPUTED_FOUR, *kill_at(3, root / "kill.marker")
        ),
    }
    # (64 tokens a chunk: several of each micro-batch; the threshold's default, 32768, takes
    # the hidden states, twice it the logits.)
    cmds["big_head"] = two_steps("big_head", "sigmoid", [*big, "task.chunk_size=64"], route=None)
    over = f"task.chunked_vocab_threshold={2 * BIG_VOCAB}"
    cmds["big_logits"] = two_steps(
        "big_logits", "sigmoid", [*big, "task.chunk_size=64", over], route=None
    )
    cmds["big_plain"] = two_steps(
        "big_plain", "sigmoid", [*big, "task.chunk_size=null"], route=None
    )
    procs = launch_all(cmds, TIMEOUT)
    procs["rerun"] = launch(cmds["killed"], TIMEOUT)
    rows = {"train": pair_rows(PAIRS, seed=5), "val": pair_rows(2, seed=6)}
    return {"root": root, "tok": tok, "procs": procs, "rows": rows}


# --------------------------------------------------------------------------- the reference


def sides(tok: Any, row: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """(ids, answer mask) of the chosen and the rejected side, rendered by transformers: the
    generation-marked tokens after the prompt (rendered with its generation prompt)."""
    if "prompt" in row:
        prompt = [{"role": "user", "content": row["prompt"]}]
        convs = [
            [*prompt, {"role": "assistant", "content": row[s]}] for s in ("chosen", "rejected")
        ]
    else:
        convs = [row["chosen"], row["rejected"]]
        prompt = convs[0][:-1]
    head = tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)
    head = head["input_ids"]
    out = []
    for messages in convs:
        enc = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = enc["input_ids"], enc["assistant_masks"]
        assert ids[: len(head)] == head  # the prompt's tokens start the conversation's
        out.append((ids, [m if i >= len(head) else 0 for i, m in enumerate(mask)]))
    return out


def log_probs(model: torch.nn.Module, pairs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, 2) summed log-probabilities of each side's answer tokens, and their numbers."""
    sums, counts = [], []
    for pair in pairs:
        for ids, mask in pair:
            out = model(torch.tensor(ids)[None])
            logits = (out if isinstance(out, torch.Tensor) else out.logits)[0, :-1]  # t -> t + 1
            picked = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            keep = torch.tensor(mask[1:], dtype=torch.float64)
            sums.append((picked * keep).sum())
            counts.append(keep.sum())
    return torch.stack(sums).view(-1, 2), torch.stack(counts).view(-1, 2)


def losses(
    name: str, policy: torch.nn.Module, ref: torch.nn.Module | None, pairs: list[Any]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-pair losses (P,) and the mean rewards, as the papers (and TRL) write them."""
    loss_type, beta, eps, gamma = LOSSES[name]
    pi, n = log_probs(policy, pairs)
    if loss_type == "simpo":
        avg = pi / n
        x = beta * (avg[:, 0] - avg[:, 1]) - gamma
        out = -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)
        rewards = beta * avg.detach()
    else:
        with torch.no_grad():
            r = log_probs(ref, pairs)[0]
        if loss_type == "ipo":
            pi, r = pi / n, r / n
        h = (pi[:, 0] - r[:, 0]) - (pi[:, 1] - r[:, 1])
        if loss_type == "ipo":
            out = (h - 1 / (2 * beta)) ** 2
        elif loss_type == "hinge":  # TRL: relu(1 - beta * logits)
            out = torch.relu(1 - beta * h)
        elif loss_type == "robust":  # TRL: (-ls(b h)(1 - eps) + ls(-b h) eps) / (1 - 2 eps)
            out = (-F.logsigmoid(beta * h) * (1 - eps) + F.logsigmoid(-beta * h) * eps) / (
                1 - 2 * eps
            )
        else:
            out = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
        rewards = beta * (pi - r).detach()
    means = {
        "reward_chosen": float(rewards[:, 0].mean()),
        "reward_rejected": float(rewards[:, 1].mean()),
        "reward_margin": float((rewards[:, 0] - rewards[:, 1]).mean()),
        "reward_accuracy": float((rewards[:, 0] > rewards[:, 1]).double().mean()),
    }
    return out, means


def reference(
    name: str,
    pairs: list[Any],
    val: list[Any],
    frozen: bool = True,
    policy: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """Two float64 SGD steps over the whole set (the mean over pairs) of `policy` (default: the
    run's gpt_tiny): the step-2 gradient, each step's loss and rewards, and the loss and
    rewards of the `val` pairs after them. `frozen=False`: the textbook bug, the reference
    following the policy."""
    from trainer.models.gpt import GPT

    if policy is None:
        torch.manual_seed(1337)  # the trainer's seed, right before it builds the model
        policy = GPT(vocab_size=320, block_size=MAX_LENGTH, n_layer=2, n_head=2, n_embd=32)
    policy = policy.double()
    ref = copy.deepcopy(policy).requires_grad_(False)
    out: dict[str, Any] = {}
    for step in (1, 2):
        policy.zero_grad()
        per_pair, rewards = losses(name, policy, ref if frozen else policy, pairs)
        per_pair.mean().backward()
        out[step] = {"loss": float(per_pair.detach().mean()), **rewards}
        out["grads"] = {n: p.grad.clone() for n, p in policy.named_parameters()}
        with torch.no_grad():
            for p in policy.parameters():
                p -= LR * p.grad
    with torch.no_grad():
        per_pair, rewards = losses(name, policy, ref, val)
    out["val"] = {"loss": float(per_pair.mean()), **rewards}
    return out


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    diff = sum(float((got[n].double() - want[n]).pow(2).sum()) for n in want)
    norm = sum(float(want[n].pow(2).sum()) for n in want)
    return (diff / norm) ** 0.5


@pytest.fixture(scope="module")
def references(runs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    pairs, val = ([sides(runs["tok"], r) for r in runs["rows"][k]] for k in ("train", "val"))
    out = {name: reference(name, pairs, val) for name in LOSSES}
    out["bug"] = reference("sigmoid", pairs, val, frozen=False)
    return out


# --------------------------------------------------------------------------- the tests


LOSS_OF = {"whole": "sigmoid", "accum": "sigmoid", "ddp": "sigmoid", "ipo": "ipo", "simpo": "simpo"}
LOSS_OF |= {"hinge": "hinge", "robust": "robust"}  # TRL's, one class each
LOSS_OF["packed"] = "sigmoid"  # each pair one row, its sides two documents
LOSS_OF["fsdp"] = "sigmoid"
LOSS_OF["precomputed"] = "sigmoid"  # the reference's log-probabilities written before step 1
LOSS_OF["tp_precomputed"] = "sigmoid"  # the same, scored by 2 tensor-parallel ranks


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LOSS_OF))
def test_second_step_has_the_float64_whole_set_gradient(
    name: str, runs: dict[str, Any], references: dict[str, dict[str, Any]]
) -> None:
    proc = runs["procs"][name]
    assert proc.returncode == 0, explain(proc)
    got = torch.load(runs["root"] / f"{name}.pt", weights_only=True)
    error = relative_error(got, references[LOSS_OF[name]]["grads"])
    assert error <= TOL, (name, error)
    where = "sharded like the policy" if name == "fsdp" else "whole on each rank"
    if name.endswith("precomputed"):
        line = "task.reference=precomputed: the initial model's log-probabilities of 10 pairs "
        assert line + "computed (each rank its share) and written to" in proc.stdout
    elif LOSS_OF[name] != "simpo":  # (simpo has no reference)
        assert f"task.reference=copy: a frozen copy of the initial model, {where}" in proc.stdout
    # The tolerance means something: a reference that follows the policy is far outside it.
    assert relative_error(references["bug"]["grads"], references["sigmoid"]["grads"]) > 100 * TOL


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LOSS_OF))
def test_records_are_the_exact_means_over_the_pairs(
    name: str, runs: dict[str, Any], references: dict[str, dict[str, Any]]
) -> None:
    """train/loss and train/reward_* of both steps equal the reference's means over the 8
    pairs (at step 1 every reward is 0: the policy is the reference)."""
    proc = runs["procs"][name]
    assert proc.returncode == 0, explain(proc)
    loss = LOSS_OF[name]
    records = {r["step"]: r for r in train_records(read_metrics(runs["root"] / name))}
    for step in (1, 2):
        want = references[loss][step]
        got = {k: records[step][f"train/{k}"] for k in want}
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), (name, step)
    assert records[2]["train/reward_margin"] != 0.0


@pytest.mark.multiproc
def test_lora_scores_the_reference_with_the_adapters_disabled(runs: dict[str, Any]) -> None:
    """adapter=lora: the reference is the base with the adapters off (peft's
    disable_adapter(), no copy of the weights). LoRA's B starts at 0, so the initial model
    is the base: the step-2 gradient of the adapters equals that of a frozen copy of the
    initial model (task.reference=copy), also on 2 FSDP2 ranks, and the rewards are not 0
    (the reference did not follow the policy's step 1)."""
    procs, root = runs["procs"], runs["root"]
    for name in ("lora_adapter", "lora_copy"):
        assert procs[name].returncode == 0, explain(procs[name])
    assert "task.reference" not in " ".join(procs["lora_adapter"].args)
    line = "task.reference=adapter: the base with its adapters disabled (no copy of the weights)"
    assert line in procs["lora_adapter"].stdout
    adapter = torch.load(root / "lora_adapter.pt", weights_only=True)
    frozen = torch.load(root / "lora_copy.pt", weights_only=True)
    assert adapter and all("lora_" in n for n in adapter), sorted(adapter)
    assert relative_error(adapter, {n: g.double() for n, g in frozen.items()}) <= TOL
    # On 2 FSDP2 ranks (2 pairs x 2 micro-batches each), the same gradient.
    assert procs["lora_fsdp"].returncode == 0, explain(procs["lora_fsdp"])
    assert line in procs["lora_fsdp"].stdout
    sharded = torch.load(root / "lora_fsdp.pt", weights_only=True)
    assert relative_error(sharded, {n: g.double() for n, g in frozen.items()}) <= TOL
    records = {r["step"]: r for r in train_records(read_metrics(root / "lora_adapter"))}
    assert records[1]["train/reward_margin"] == 0.0
    assert abs(records[2]["train/reward_chosen"]) > 1e-4


@pytest.mark.multiproc
def test_chunked_log_probs_equal_the_whole_log_softmax_without_its_memory(
    runs: dict[str, Any],
) -> None:
    """At a real vocabulary (32768) the log-probabilities taken 64 tokens at a time, from the
    GPT's hidden states (the default: its output layer declared, at the threshold) and from
    its logits, give the step-2 gradient and both steps' records of the whole fp32 log-softmax
    (task.chunk_size=null) to round-off. The measured peak (train.memory_report=true) drops by
    more than two fp32 (rows, T, V) tensors of the largest micro-batch from the hidden states
    (no logits are held, in the policy's forward, its backward or the reference's: 2.6
    measured), and by one from fp32 logits, which the model holds either way (what goes is
    the log-softmax of the whole tensor; asserted less one (64, V) chunk). Before, task=dpo
    took the whole log-softmax: the peaks were equal."""
    import json

    root, procs = runs["root"], runs["procs"]
    for name in ("big_head", "big_logits", "big_plain"):
        assert procs[name].returncode == 0, explain(procs[name])
    plain = {n: g.double() for n, g in torch.load(root / "big_plain.pt", weights_only=True).items()}
    records = {n: train_records(read_metrics(root / n)) for n in ("big_plain", "big_head")}
    records["big_logits"] = train_records(read_metrics(root / "big_logits"))
    for name in ("big_head", "big_logits"):
        error = relative_error(torch.load(root / f"{name}.pt", weights_only=True), plain)
        assert error <= TOL, (name, error)
        for got, want in zip(records[name], records["big_plain"], strict=True):
            assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-6)
            assert got["train/reward_margin"] == pytest.approx(
                want["train/reward_margin"], rel=1e-5
            )
    assert records["big_plain"][1]["train/reward_margin"] != 0.0
    peak = {
        name: json.loads((root / name / "memory_report.json").read_text())["ranks"][0]["peak_bytes"]
        for name in ("big_head", "big_logits", "big_plain")
    }
    # The largest micro-batch: 2 pairs, 4 rows, as long as the longest side of any pair.
    longest = max(len(ids) for row in runs["rows"]["train"] for ids, _ in sides(runs["tok"], row))
    logits = 4 * longest * BIG_VOCAB * 4  # fp32 (rows, T, V)
    assert peak["big_plain"] - peak["big_head"] >= 2 * logits, (peak, logits)
    chunk = 64 * BIG_VOCAB * 4
    assert peak["big_plain"] - peak["big_logits"] >= logits - chunk, (peak, logits)


# The runs of each task.reference whose memory is measured (train.memory_report=true).
MEASURED = {"accum": "copy", "lora_adapter": "adapter", "precomputed": "precomputed"}
MEASURED["simpo"] = "none"


@pytest.mark.multiproc
def test_plan_counts_the_frozen_reference_copy(runs: dict[str, Any], tmp_path: Path) -> None:
    """task.reference=copy holds a frozen copy of the initial model beside the policy: the plan
    counts its weights from the step's start (`reference_bytes`: 4 bytes per parameter of the
    model, among the parameters at the peak) and its no-grad forward among the step's tensors,
    the peak within 10% of the measured run's (train.memory_report=true, which reports the
    copy's bytes too). adapter (the policy's own base), precomputed and none (simpo) hold no
    second model: 0 measured (and planned for precomputed: the test below). The measured
    adapter run is also the tracker's under LoRA's default reference, whose forward with the
    adapters off (the policy's own modules again) reset what the policy's backward then read:
    it failed with a KeyError, as did trainer.plan of it."""
    import json

    from trainer.plan import main

    root = runs["root"]
    for name in MEASURED:
        assert runs["procs"][name].returncode == 0, explain(runs["procs"][name])
    measured = {
        mode: json.loads((root / name / "memory_report.json").read_text())["ranks"]
        for name, mode in MEASURED.items()
    }
    args = [*data_args(root, root / "pairs.jsonl", root / "val.jsonl"), *task_args("sigmoid")]
    args += [*TWO_STEPS, *batch(2), "plan.world=1"]
    main([*args, f"plan.out={tmp_path / 'plan.json'}"])
    planned = json.loads((tmp_path / "plan.json").read_text())
    (role,) = planned["roles"]
    (real,) = measured["copy"]
    weights = 4 * planned["parameters"]  # fp32: the whole model, once more
    assert role["reference_bytes"] == real["reference_bytes"] == weights, (role, real)
    assert role["at_peak"]["PARAM"] == role["parameters_bytes"] + weights
    assert 0.9 <= role["peak_bytes"] / real["peak_bytes"] <= 1.1, (role, real)
    for mode in ("adapter", "precomputed", "none"):
        assert all(r["reference_bytes"] == 0 for r in measured[mode]), mode


@pytest.mark.multiproc
def test_precomputed_reference_is_read_back_and_keyed_to_the_base(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """task.reference=precomputed: the pass of 2 FSDP2 ranks (the model sharded: it fits only
    so) writes the bits one process writes under the same key; its step 1 is the frozen
    sharded copy's (task.reference=copy), loss and rewards. A start on the same pairs and the
    same initial model reads the values written (no pass; and the values read are the ones
    used: shifted by 1 nat, step 1's chosen reward is -beta); another base (seed=7, another
    initial model) computes its own, under another key. Nothing but whole files is left in
    the cache (each written to a temporary name and renamed)."""
    proc, root = runs["procs"]["precomputed"], runs["root"]
    assert proc.returncode == 0, explain(proc)
    written = proc.stdout.split("computed (each rank its share) and written to ")[1].split()[0]
    path = Path(written)
    assert path.is_file()
    sharded = torch.load(path, weights_only=True)
    assert {k: v.shape for k, v in sharded.items()} == {"train": (PAIRS, 2), "val": (2, 2)}
    steps = [train_records(read_metrics(root / name))[0] for name in ("precomputed", "fsdp")]
    keys = ["train/loss", "train/reward_chosen", "train/reward_rejected", "train/reward_margin"]
    assert [steps[0][k] for k in keys] == [steps[1][k] for k in keys], steps
    assert steps[0]["train/reward_margin"] == 0.0
    args = [
        *data_args(root, root / "pairs.jsonl", root / "val.jsonl"),
        *task_args("sigmoid"),
        *(a for a in TWO_STEPS if not a.startswith("train.max_steps")),
        "train.max_steps=1",
        *batch(2),  # the launched run's micro-batch: its key
        "task.reference=precomputed",
    ]
    # One process computes the same key's values anew: the sharded pass's bits.
    path.unlink()
    capsys.readouterr()
    first = train_records(train_in_process(args, root / "precomputed_again"))[0]
    out = capsys.readouterr().out
    assert (
        f"log-probabilities of 10 pairs computed (each rank its share) and written to {path}" in out
    )
    stored = torch.load(path, weights_only=True)
    assert all(torch.equal(stored[k], sharded[k]) for k in sharded), (stored, sharded)
    # The policy is the reference at step 1: the same chunks of 2 pairs, the same bits.
    assert first["train/reward_margin"] == 0.0
    capsys.readouterr()
    again = train_records(train_in_process(args, root / "precomputed_read"))[0]
    assert f"log-probabilities of 10 pairs read from {path}" in capsys.readouterr().out
    assert again["train/reward_margin"] == 0.0
    try:
        shifted = {k: v + torch.tensor([1.0, 0.0], dtype=v.dtype) for k, v in stored.items()}
        torch.save(shifted, path)
        moved = train_records(train_in_process(args, root / "precomputed_shifted"))[0]
    finally:
        torch.save(stored, path)
    beta = LOSSES["sigmoid"][1]
    assert moved["train/reward_chosen"] == pytest.approx(-beta, rel=1e-5)
    assert moved["train/reward_margin"] == pytest.approx(-beta, rel=1e-5)
    capsys.readouterr()
    train_in_process([*args, "seed=7"], root / "precomputed_other_base")
    out = capsys.readouterr().out
    assert "pairs computed (each rank its share) and written to" in out, out
    other = Path(out.split("written to ")[1].split()[0])
    assert other != path and other.parent == path.parent and other.is_file()
    assert not [p.name for p in path.parent.iterdir() if not p.name.endswith(".pt")]
    # Under bf16 autocast the pass scores as the step scores the policy (it scored in fp32:
    # step 1's rewards were the policy's bf16 rounding, not 0), and bf16 values are a key of
    # their own.
    bf16 = train_records(train_in_process([*args, "train.precision=bf16"], root / "bf16"))[0]
    for key in ("reward_chosen", "reward_rejected", "reward_margin"):
        assert abs(bf16[f"train/{key}"]) <= 1e-6, bf16


@pytest.mark.multiproc
def test_precomputed_reference_on_tensor_parallel_ranks(runs: dict[str, Any]) -> None:
    """task.reference=precomputed under dist.tp=2: the 2 ranks of the tensor-parallel group
    score each chunk together (chunks are dealt over the data-parallel ranks, here 1), and
    the first rank's values are kept: the values are the one-process pass's (1e-6, the split
    matmuls add in another order), under a key of their own, and at step 1 they cancel the
    policy's exactly. Chunks dealt over the 2 ranks fed 2 different chunks through the same
    split layers (the run aborted in the tensor-parallel all-reduce of chunks padded to
    different lengths)."""
    proc, root = runs["procs"]["tp_precomputed"], runs["root"]
    assert proc.returncode == 0, explain(proc)
    written = proc.stdout.split("computed (each rank its share) and written to ")[1].split()[0]
    sharded = runs["procs"]["precomputed"]  # FSDP2's values: the one-process pass's bits
    assert sharded.returncode == 0, explain(sharded)
    whole = sharded.stdout.split("computed (each rank its share) and written to ")[1].split()[0]
    assert written != whole
    got, want = (torch.load(path, weights_only=True) for path in (written, whole))
    for split in ("train", "val"):
        torch.testing.assert_close(got[split], want[split], rtol=1e-6, atol=1e-6)
    first = train_records(read_metrics(root / "tp_precomputed"))[0]
    assert [first[f"train/reward_{k}"] for k in ("chosen", "rejected", "margin")] == [0.0] * 3


@pytest.mark.multiproc
def test_a_killed_run_reruns_bit_for_bit_reading_its_reference(runs: dict[str, Any]) -> None:
    """task.reference=precomputed, killed with -9 at step 3 and started again: it resumes
    from step 2, reads the reference values written by the first start (no pass), and its 4
    steps' loss and rewards equal the uninterrupted run's bit for bit."""
    procs, root = runs["procs"], runs["root"]
    assert procs["four"].returncode == 0, explain(procs["four"])
    assert killed(procs["killed"]), explain(procs["killed"])
    rerun = procs["rerun"]
    assert rerun.returncode == 0, explain(rerun)
    assert "resumed from" in rerun.stdout, explain(rerun)
    assert "log-probabilities of 10 pairs read from" in rerun.stdout, explain(rerun)
    keys = ["train/loss", "train/reward_chosen", "train/reward_margin", "train/reward_accuracy"]
    want = {r["step"]: [r[k] for k in keys] for r in train_records(read_metrics(root / "four"))}
    got = {r["step"]: [r[k] for k in keys] for r in train_records(read_metrics(root / "killed"))}
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    assert got == want
    assert want[4][2] != 0.0


@pytest.mark.multiproc
def test_certify_passes_pairs_and_skips_context_parallelism(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """trainer.certify on a DPO run (gpt_tiny, 8 pairs a step, 3 steps): micro-batches of 2
    pairs train as the one-process reference (exit 0, train/loss and grad norm within 1e-5),
    and cp2 is skipped with the trainer's reason (a pair's sequences are not split)."""
    from tests.ranks import launch

    root = runs["root"]
    args = data_args(root, root / "pairs.jsonl", root / "val.jsonl")
    cmd = [sys.executable, "-m", "trainer.certify", *args, *task_args("sigmoid")]
    cmd += ["train.micro_batch_size=4", "train.grad_accum_steps=2", "certify.steps=3"]
    cmd += ["certify.layouts=[accum,cp2]", f"certify.dir={tmp_path / 'work'}"]
    proc = launch(cmd, TIMEOUT)
    assert proc.returncode == 0, explain(proc)
    assert "CERTIFIED: 1 layout trains as the reference" in proc.stdout, explain(proc)
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert lines["accum"].endswith("same"), lines["accum"]
    assert "skipped: the trainer refuses it: invalid config `dist.cp`: task=dpo" in lines["cp2"]


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def bad_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dpo_bad")
    make_tokenizer(root / "tok")
    return root


def open_data(root: Path, rows: list[Any], name: str, *extra: str) -> Any:
    path = write_jsonl(root / f"{name}.jsonl", rows)
    val = write_jsonl(root / "val.jsonl", pair_rows(2, seed=6))
    args = [*data_args(root, path, val), *extra]
    return build_data(to_config(compose_config(args))[0].data)[0]


# Rows that hold no pair, each as data=chat names its kind: (row, what the paragraph says of it).
BAD_ROWS = [
    ({"prompt": "what", "chosen": "yes"}, "has no 'rejected' (its fields: 'prompt', 'chosen')"),
    (
        {"prompt": "what", "chosen": [{"role": "assistant", "content": 3}], "rejected": "no"},
        "message 1 of 'chosen' (assistant) has content of type int (3)",
    ),
    ({"prompt": 7, "chosen": "yes", "rejected": "no"}, "'prompt' is a int (7)"),
    ({"prompt": "what", "chosen": "yes", "rejected": 3}, "'rejected' is a int (3)"),
    ({"chosen": "yes", "rejected": "no"}, "'chosen' is a str ('yes'), expected a list of messages"),
]


def test_bad_rows_are_refused_naming_each_line(bad_root: Path) -> None:
    """By default (data.bad_rows=refuse) a row that is no pair stops the run, as data=chat's
    do: one paragraph naming each by FILE:LINE and what is wrong, then what is valid and the
    key that drops them instead; nothing is left in the cache."""
    rows = [*pair_rows(2, seed=1), *(row for row, _ in BAD_ROWS), *pair_rows(2, seed=3)]
    with pytest.raises(UserError) as err:
        open_data(bad_root, rows, "named")
    message = str(err.value)
    path = bad_root / "named.jsonl"
    assert "\n" not in message, message
    assert message.startswith(f"data.path: {len(BAD_ROWS)} rows of {path} cannot be used"), message
    for line, (_, what) in enumerate(BAD_ROWS, start=3):
        assert f"{path}:{line}: {what}" in message or f"{path}:{line} {what}" in message, (
            line,
            message,
        )
    assert 'data=preference reads rows of "prompt"' in message, message
    assert "data.bad_rows=drop" in message, message
    assert not list((bad_root / ".cumulus-cache").glob("named_jsonl-*/index.json"))


def test_bad_rows_dropped_on_request_are_counted_in_one_line(bad_root: Path) -> None:
    """data.bad_rows=drop: every row that holds no pair is dropped and counted by kind, beside
    those with no answer after the prompt and the ones too long (dropped either way)."""
    rows = pair_rows(4, seed=1)
    rows += [row for row, _ in BAD_ROWS]  # 1 without a side, 4 whose content is not text
    rows += [
        {
            "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "ho"}, {"role": "assistant", "content": "b"}],
        },  # prompts differ
        {
            "chosen": [{"role": "user", "content": "hi"}],
            "rejected": [{"role": "user", "content": "hi"}],
        },  # no answer
        {"prompt": "what " * 400, "chosen": "yes", "rejected": "no"},  # longer than max_length
    ]
    data = open_data(bad_root, rows, "mixed", "data.bad_rows=drop")
    assert len(data.train) == 4
    line = data.description
    assert "\n" not in line
    assert "8 pairs dropped (1 without chosen or rejected, 4 whose content is not text" in line
    assert "1 whose chosen and rejected prompts differ, 1 with no answer after the prompt" in line
    assert "1 with a side longer than data.max_length" in line


def test_cut_keeps_the_first_tokens_of_a_long_pair(bad_root: Path) -> None:
    rows = [{"prompt": "what is it", "chosen": "yes " * 400, "rejected": "no"}]
    data = open_data(bad_root, rows, "cut", "data.truncation=cut")
    assert len(data.train) == 1
    sample = data.train[0]
    assert sample["input_ids"].shape == (2, MAX_LENGTH)
    assert (sample["shift_labels"][1] != -100).any()


def test_prompts_that_differ_are_one_paragraph(bad_root: Path) -> None:
    rows = pair_rows(2, seed=1)
    rows.append(
        {
            "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "ho"}, {"role": "assistant", "content": "b"}],
        }
    )
    with pytest.raises(UserError) as err:
        open_data(bad_root, rows, "differ")
    message = str(err.value)
    assert "differ.jsonl" in message and ":3" in message, message
    assert "do not share their prompt" in message and "\n" not in message


@pytest.mark.parametrize(
    ("row", "extra", "said"),
    [
        (
            {"prompt": "what", "chosen": "yes"},
            ["data.bad_rows=drop"],
            "5 without chosen or rejected",
        ),
        (
            {"prompt": "what " * 400, "chosen": "yes", "rejected": "no"},
            [],
            "5 with a side longer than data.max_length",
        ),
    ],
)
def test_a_set_without_pairs_names_its_file_and_counts_every_row(
    bad_root: Path, row: dict[str, Any], extra: list[str], said: str
) -> None:
    """5 rows, none a pair to train on, with no data.val_path: the count is of the file's
    every row, the one held out for validation too (it said 4)."""
    path = write_jsonl(bad_root / f"empty{len(extra)}.jsonl", [row] * 5)
    args = [*data_args(bad_root, path), *extra]
    with pytest.raises(UserError) as err:
        build_data(to_config(compose_config(args))[0].data)
    message = str(err.value)
    assert f"empty{len(extra)}.jsonl holds no pair to train on" in message, message
    assert f"5 pairs dropped ({said})" in message, message


def test_bad_rows_takes_refuse_or_drop(bad_root: Path) -> None:
    path = write_jsonl(bad_root / "ok_rows.jsonl", pair_rows(4, seed=2))
    with pytest.raises(UserError) as err:
        build_data(
            to_config(compose_config([*data_args(bad_root, path), "data.bad_rows=skip"]))[0].data
        )
    message = str(err.value)
    assert "data.bad_rows" in message and "refuse" in message and "drop" in message, message


def test_reference_adapter_without_an_adapter_names_the_key(bad_root: Path) -> None:
    path = write_jsonl(bad_root / "ok.jsonl", pair_rows(4, seed=2))
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    args = [*data_args(bad_root, path, val), "task=dpo", "task.reference=adapter"]
    with pytest.raises(UserError) as err:
        train_in_process([*args, "logger=none", "train.max_steps=1"], bad_root / "run")
    message = str(err.value)
    assert message.startswith("invalid config `task.reference`: adapter"), message
    assert "adapter=lora" in message and "task.reference=copy" in message


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["whole", "precomputed"])
def test_evaluation_reports_the_val_means(
    name: str, runs: dict[str, Any], references: dict[str, dict[str, Any]]
) -> None:
    """The final evaluation (after step 2) reports val/loss and val/reward_* over the 2
    validation pairs (precomputed: their reference values written with the training pairs'),
    and writes a text sample from the first pair's prompt."""
    proc = runs["procs"][name]
    assert proc.returncode == 0, explain(proc)
    val = [r for r in read_metrics(runs["root"] / name) if "val/loss" in r]
    assert [r["step"] for r in val] == [2]
    want = references["sigmoid"]["val"]
    got = {k: val[0][f"val/{k}"] for k in want}
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert val[0]["val/items"] == 2
    # The sample continues the first validation pair's prompt (its chosen side's).
    last_user = runs["rows"]["val"][0]["chosen"][-2]["content"]
    assert last_user in val[0]["val/sample"], val[0]["val/sample"]


def test_a_resumed_run_repeats_the_uninterrupted_one(bad_root: Path) -> None:
    """A run resumed from its step-2 checkpoint repeats steps 3-4 bit for bit: the reference
    is the initial model again (rebuilt as the run builds it, never the resumed policy)."""
    import shutil

    path = write_jsonl(bad_root / "resume.jsonl", pair_rows(8, seed=3))
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    args = [
        *data_args(bad_root, path, val),
        *task_args("sigmoid"),
        "logger=none",
        "optim=sgd",
        "scheduler=constant",
        "train.max_steps=4",
        "train.log_every=1",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=2",
    ]
    whole = train_records(train_in_process(args, bad_root / "whole"))
    name = "checkpoints/step_00000002"
    shutil.copytree(bad_root / "whole" / name, bad_root / "resumed" / name)
    resumed = train_records(train_in_process(args, bad_root / "resumed"))
    assert [r["step"] for r in resumed] == [3, 4]
    keys = ["train/loss", "train/reward_chosen", "train/reward_margin", "train/reward_accuracy"]
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole[2:]]
    assert whole[3]["train/reward_margin"] != 0.0

    # scripts/export_hf.py after DPO, as after data=chat: transformers' GPT2LMHeadModel with the
    # run's tokenizer and chat template, which scores a pair's answers as the trained policy
    # does (float64, against the checkpoint's weights in the in-tree GPT).
    from scripts.export_hf import main as export
    from trainer.models.gpt import GPT

    out = bad_root / "exported"
    export(
        [f"checkpoint={bad_root / 'resumed'}", f"out={out}", f"data.tokenizer={bad_root / 'tok'}"]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    original = transformers.AutoTokenizer.from_pretrained(bad_root / "tok")
    assert tok.chat_template == original.chat_template
    pair = [sides(tok, row) for row in pair_rows(8, seed=3)[:2]]
    assert pair == [sides(original, row) for row in pair_rows(8, seed=3)[:2]]
    state = torch.load(bad_root / "resumed" / "checkpoints/step_00000004/state.pt")["model"]
    gpt = GPT(vocab_size=320, block_size=MAX_LENGTH, n_layer=2, n_head=2, n_embd=32)
    gpt.load_state_dict(state)
    with torch.no_grad():
        exported, trained = log_probs(hf, pair)[0], log_probs(gpt.double().eval(), pair)[0]
    torch.testing.assert_close(exported, trained, rtol=1e-9, atol=1e-9)


def test_preview_shows_pairs_and_counts_their_scored_tokens(
    bad_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """trainer.preview of data=preference: the first pairs training reads, each its prompt and
    both answers with the scored tokens marked, and the JSON line's counts over the training
    pairs equal transformers' rendering of the rows (the answer's assistant-marked tokens)."""
    import json

    from trainer.data.preview import first_rows
    from trainer.preview import main

    rows = pair_rows(8, seed=11)
    path = write_jsonl(bad_root / "preview.jsonl", rows)
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    main([*data_args(bad_root, path, val), "task=dpo", "preview.samples=2"])
    out = capsys.readouterr().out.strip().splitlines()
    stats = json.loads(out[-1])
    tok = transformers.AutoTokenizer.from_pretrained(bad_root / "tok")
    want = {"pairs": 8, "prompt_tokens": 0, "chosen_tokens": 0, "rejected_tokens": 0}
    want |= {"tokens": 0, "dropped": 0}
    for row in rows:
        (ids_c, mask_c), (ids_r, mask_r) = sides(tok, row)
        want["prompt_tokens"] += mask_c.index(1)
        want["chosen_tokens"] += sum(mask_c[1:])
        want["rejected_tokens"] += sum(mask_r[1:])
        want["tokens"] += len(ids_c) + len(ids_r)
    want["padding_fraction"] = pytest.approx(1 - want["tokens"] / (8 * 2 * MAX_LENGTH))
    assert stats == want
    text = "\n".join(out[:-1])
    assert text.count("=== pair ") == 2 and text.count("--- rejected ---") == 2
    first = first_rows(8, 1337, 2)[0]
    assert f"=== pair {first}: prompt " in text
    shown = text.split(f"=== pair {first}: ")[1].split("=== pair ")[0]
    prompt, answers = shown.split("--- chosen ---")
    chosen, rejected = answers.split("--- rejected ---")
    row = rows[first]
    said = {k: row[k] if "prompt" in row else row[k][-1]["content"] for k in ("chosen", "rejected")}
    asked = row["prompt"] if "prompt" in row else row["chosen"][-2]["content"]
    assert asked in prompt and "{+" not in prompt
    for answer, text_of in ((said["chosen"], chosen), (said["rejected"], rejected)):
        marked = text_of.split("{+", 1)[1].split("+}", 1)[0]
        assert answer in marked, (answer, text_of)


def test_auto_micro_batch_counts_whole_pairs_and_a_redone_window_records_once(
    bad_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train.micro_batch_size=auto on pairs: the divisors are of the pairs per rank (8), and a
    model that holds 8 rows (4 pairs: each pair two rows) is given 4. At step 3 the limit
    drops to 2 pairs after one micro-batch: the window is redone at 2 and the run, records
    included, is one started at 2 pairs by hand (float64 parameters): the rewards of the
    failed window's first micro-batch are not counted in step 3's means."""
    path = write_jsonl(bad_root / "auto.jsonl", pair_rows(8, seed=4))
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    limited = ["model._target_=tests.auto_batch_support.LimitedGPT", "+model.float64=true"]
    common = [
        *data_args(bad_root, path, val),
        *limited,
        *task_args("sigmoid"),
        *(a for a in TWO_STEPS if not a.startswith("train.max_steps")),
        "train.max_steps=4",
        "train.global_batch_size=8",
    ]
    lower = "+callbacks.lower={_target_:tests.auto_batch_support.LowerLimit,"
    lower += "at_step:2,fit:4,skip:1}"
    capsys.readouterr()
    auto = train_records(
        train_in_process(
            [*common, "train.micro_batch_size=auto", "+model.fit=8", lower], bad_root / "auto"
        )
    )
    captured = capsys.readouterr()
    assert "chose 4 of the divisors of the per-rank batch 8" in captured.out, captured.out
    assert "shrinking the micro-batch to 2" in captured.err, captured.err
    assert [r["train/micro_batch_size"] for r in auto] == [4, 4, 2, 2]
    hand = train_records(train_in_process([*common, "train.micro_batch_size=2"], bad_root / "hand"))
    keys = ["train/loss", *(f"train/{k}" for k in ("reward_chosen", "reward_margin"))]
    keys.append("train/reward_accuracy")
    for a, h in zip(auto, hand, strict=True):
        assert [a[k] for k in keys] == pytest.approx([h[k] for k in keys], rel=1e-9, abs=1e-12)
    assert hand[2]["train/reward_margin"] != 0.0


def test_plan_of_a_precomputed_run_needs_no_pass(bad_root: Path, tmp_path: Path) -> None:
    """trainer.plan of task.reference=precomputed (2 simulated ranks): the model is fake
    tensors, so there is nothing to score; the planned step reads zeros of the values'
    shape (it failed on the batch without them) and no reference file is written."""
    import json

    from trainer.plan import main

    path = write_jsonl(bad_root / "plan.jsonl", pair_rows(8, seed=12))
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    out = tmp_path / "plan.json"
    args = [*data_args(bad_root, path, val), *task_args("sigmoid"), *batch(2)]
    main([*args, "task.reference=precomputed", "plan.world=2", "plan.gpu=h100", f"plan.out={out}"])
    plan = json.loads(out.read_text())
    assert plan["world"] == 2 and all(role["fits"] for role in plan["roles"]), plan
    assert all(role["reference_bytes"] == 0 for role in plan["roles"])  # no second model
    assert not list(bad_root.glob(".cumulus-cache/plan_jsonl-*/reference/*"))


@needs_torchao
def test_fp8_copies_the_converted_policy(bad_root: Path) -> None:
    """train.precision=fp8 (emulated) with task.reference=copy: the reference is copied from
    the policy once its Linear layers are float8, so at step 1 the two score alike: every
    reward is 0 and the loss log 2 (the copy was taken before the conversion: plain layers
    under bf16 autocast against the policy's float8 matmuls, rewards not 0)."""
    path = write_jsonl(bad_root / "fp8.jsonl", pair_rows(4, seed=2))
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    args = [*data_args(bad_root, path, val), *task_args("sigmoid"), "task.reference=copy"]
    args += [*(a for a in TWO_STEPS if not a.startswith("train.max_steps")), "train.max_steps=1"]
    args += ["train.micro_batch_size=2", "train.grad_accum_steps=2"]
    args += ["train.precision=fp8", "train.fp8_emulate=true"]
    (first,) = train_records(train_in_process(args, bad_root / "fp8_copy"))
    assert [first[f"train/reward_{k}"] for k in ("chosen", "rejected", "margin")] == [0.0] * 3
    assert first["train/loss"] == pytest.approx(math.log(2), rel=1e-6)


@needs_torchao
def test_precomputed_key_follows_the_parameters_the_layout_computes_with(bad_root: Path) -> None:
    """The precomputed reference's key names what of the layout changes its values, as
    `parameter_dtype` (the dtype `parallelize` lays out with) and dist.tp decide: fp8 (and
    bf16) on 2 FSDP2 ranks computes with bf16 parameters, a key apart from one process's (fp8
    reused one process's file: step 1 no longer cancelled); DDP with dist.ep=2 computes with
    the fp32 parameters, one process's key (it had its own); dist.tp=2 splits the matmuls, a
    key of its own, and another with dist.tp_sequence_parallel=true."""
    from engine.distributed import DistInfo
    from trainer.run.assemble import build_model, build_task
    from trainer.run.extensions.preference import layout_reference_file
    from trainer.run.layout import parameter_dtype

    path = write_jsonl(bad_root / "keys.jsonl", pair_rows(4, seed=2))
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    args = [*data_args(bad_root, path, val), "task=dpo", "task.reference=precomputed"]
    cfg = to_config(compose_config([*args, "train.precision=fp8", "train.fp8_emulate=true"]))[0]
    data = build_data(cfg.data)[0]
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, DistInfo())[0]
    task = build_task(cfg.task)
    one, two = DistInfo(), DistInfo(0, 2)
    whole = cfg.dist.dims(1)
    fsdp = dataclasses.replace(cfg.dist.dims(2), strategy="fsdp")
    ep = dataclasses.replace(cfg.dist.dims(2), strategy="ddp", ep=2)
    tp = dataclasses.replace(cfg.dist.dims(2), strategy="ddp", tp=2)

    def key(precision: str, dims: Any, info: DistInfo) -> Path:
        cfg.train.precision = precision
        file = layout_reference_file(cfg, task, model, data, dims, info)
        assert file is not None
        return file.path

    for precision in ("fp8", "bf16"):
        assert parameter_dtype(precision, fsdp, two) is torch.bfloat16
        assert key(precision, fsdp, two) != key(precision, whole, one), precision
        assert parameter_dtype(precision, ep, two) is None
        assert key(precision, ep, two) == key(precision, whole, one), precision
    assert parameter_dtype("fp32", fsdp, two) is None
    assert key("fp32", fsdp, two) == key("fp32", whole, one)  # FSDP2 in fp32: the same bits
    assert key("fp32", tp, two) != key("fp32", whole, one)
    sp = dataclasses.replace(tp, sequence_parallel=True)  # norms on sequence shards
    assert key("fp32", sp, two) not in (key("fp32", tp, two), key("fp32", whole, one))


def test_cuda_graphs_are_refused_before_the_model_is_built(bad_root: Path) -> None:
    """train.compile_mode=reduce-overhead on pairs (data.packed=false: padded to each
    micro-batch's longest row) is refused as soon as the data is built: with
    task.reference=precomputed, no model is built and no reference pass runs (the refusal
    came after the whole build: the model compiled and the pass written to the cache)."""
    path = write_jsonl(bad_root / "graphs.jsonl", pair_rows(4, seed=2))
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    args = [*data_args(bad_root, path, val), *task_args("sigmoid"), "task.reference=precomputed"]
    args += ["logger=none", "train.compile=true", "train.compile_mode=reduce-overhead"]
    # A model that cannot be built (2 heads do not divide 33 channels): its error would come
    # first were the model built before the refusal.
    args += ["model.n_embd=33"]
    with pytest.raises(UserError) as err:
        train_in_process(args, bad_root / "graphs")
    message = str(err.value)
    assert message.startswith("invalid config `data.packed`: train.compile_mode=reduce-"), message
    assert not list(bad_root.glob(".cumulus-cache/graphs_jsonl-*/reference/*"))


def test_cut_of_packed_pairs_names_the_key(bad_root: Path) -> None:
    with pytest.raises(UserError) as err:
        open_data(
            bad_root, pair_rows(4, seed=1), "packed_cut", "data.packed=true", "data.truncation=cut"
        )
    message = str(err.value)
    assert "data.truncation" in message and "data.packed=false" in message, message


def test_preference_data_with_another_task_names_task_dpo(bad_root: Path) -> None:
    path = write_jsonl(bad_root / "ok.jsonl", pair_rows(4, seed=2))
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    with pytest.raises(UserError) as err:
        train_in_process([*data_args(bad_root, path, val), "logger=none"], bad_root / "lm")
    message = str(err.value)
    assert message.startswith("invalid config `task`: data=preference gives pairs"), message
    assert "task=dpo" in message


def test_sequence_and_pipeline_splits_are_refused_naming_the_key(bad_root: Path) -> None:
    """dist.cp would cut the (pairs, 2, positions) batch along its sides; dist.pp runs the
    loss on the last stage alone: both refused before anything trains."""
    from engine.distributed import DistInfo
    from trainer.config.cli import to_config as config_of
    from trainer.run.assemble import assemble

    path = write_jsonl(bad_root / "ok.jsonl", pair_rows(4, seed=2))
    val = write_jsonl(bad_root / "val.jsonl", pair_rows(2, seed=6))
    cfg = config_of(compose_config([*data_args(bad_root, path, val), "task=dpo"]))[0]
    for key in ("cp", "pp"):
        dims = dataclasses.replace(cfg.dist.dims(2), **{key: 2})
        with pytest.raises(UserError) as err:
            assemble(cfg, DistInfo(), dims)
        assert str(err.value).startswith(f"invalid config `dist.{key}`: task=dpo"), err.value


def test_a_pretrained_transformers_model_records_its_rewards(bad_root: Path) -> None:
    """model=hf_llama from a pretrained directory (which transformers loads in eval mode):
    the step-2 gradient and the records of both steps equal the float64 reference's."""
    from tests.chat_support import DumpAllGrads, pretrained

    model_dir, tok = pretrained(bad_root / "llama")
    rows, val_rows = pair_rows(4, seed=7), pair_rows(2, seed=6)
    path = write_jsonl(bad_root / "llama.jsonl", rows)
    val = write_jsonl(bad_root / "val.jsonl", val_rows)
    args = [
        "model=hf_llama",
        f"model.pretrained={model_dir}",
        "data=preference",
        f"data.path={path}",
        f"data.val_path={val}",
        f"data.max_length={MAX_LENGTH}",
        "data.tokenize_workers=1",
        *task_args("sigmoid"),
        *TWO_STEPS,
        "train.micro_batch_size=2",
        "train.grad_accum_steps=2",
        f"+callbacks.dump._target_={DumpAllGrads.__module__}.DumpAllGrads",
        f"+callbacks.dump.path={bad_root / 'llama.pt'}",
        "+callbacks.dump.step=2",
    ]
    records = {r["step"]: r for r in train_records(train_in_process(args, bad_root / "llama_run"))}
    llama = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    llama.config.use_cache = False
    pairs, val_pairs = [sides(tok, r) for r in rows], [sides(tok, r) for r in val_rows]
    want = reference("sigmoid", pairs, val_pairs, policy=llama)
    got = torch.load(bad_root / "llama.pt", weights_only=True)
    assert relative_error(got, want["grads"]) <= TOL
    for step in (1, 2):
        recorded = {k: records[step][f"train/{k}"] for k in want[step]}
        assert recorded == pytest.approx(want[step], rel=1e-4, abs=1e-6), step
    assert records[2]["train/reward_margin"] != 0.0


@pytest.mark.parametrize("chunk", [1, 7, 64])  # 7 does not divide the 45 tokens
def test_chunked_log_probs_are_the_float64_log_softmax(chunk: int) -> None:
    """Each token's log p(target) from hidden states and the output layer (`chunked_log_probs`,
    the logits a chunk at a time, recomputed in backward) and from logits
    (`log_probs_in_chunks`), in fp32, equal the float64 whole log-softmax, and so do their
    gradients (wrt hidden states, weight, bias, logits) under a different incoming gradient per
    token, as a pair's loss weights its tokens; ignored tokens are 0 and pass no gradient."""
    from engine.numerics.chunked_ce import chunked_log_probs, log_probs_in_chunks

    gen = torch.Generator().manual_seed(3)
    n, c, v = 45, 16, 300
    hidden, weight = torch.randn(n, c, generator=gen), torch.randn(v, c, generator=gen) / 4
    bias, upstream = torch.randn(v, generator=gen), torch.randn(n, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::4] = -100
    keep = (targets != -100).double()

    def whole(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, w, b)
        return logits.log_softmax(-1).gather(1, targets.clamp(min=0)[:, None])[:, 0] * keep

    want_in = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    want = whole(*want_in)
    want_grads = torch.autograd.grad((want * upstream.double()).sum(), want_in)
    got_in = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logits = F.linear(got_in[0], got_in[1], got_in[2])  # (N, V), fp32
    for got in (
        chunked_log_probs(got_in[0], got_in[1], targets, bias=got_in[2], chunk_size=chunk),
        log_probs_in_chunks(logits, targets, chunk),
    ):
        assert got.dtype == torch.float32 and bool((got[::4] == 0).all())
        assert float((got.detach().double() - want.detach()).norm() / want.detach().norm()) <= 1e-6
        grads = torch.autograd.grad((got * upstream).sum(), got_in, retain_graph=True)
        for g, w in zip(grads, want_grads, strict=True):
            assert g.dtype == torch.float32
            assert float((g.double() - w).norm() / w.norm()) <= 1e-6
        # An ignored token's hidden state gets no gradient.
        assert bool((grads[0][::4] == 0).all())
