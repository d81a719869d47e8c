"""task=dpo on a mixture of experts (the in-tree GPT with 4 experts, top 2, in both blocks)
trains with the load balancing of the policy's own routing (moe.balance=global): the second
SGD step's gradient equals the float64 gradient of the mean sigmoid-DPO loss over the 8 pairs
+ moe.aux_coef x the Switch balancing loss of the whole batch, as 4 micro-batches of 2 pairs
(padded, and packed: each pair one row), and on 2 DDP ranks; the records `train/moe_aux_loss`
and `train/reward_*` are the reference's. The balancing counts each side's positions up to
its last answer token (what the pair's loss depends on; not the padding a micro-batch adds),
and never the reference's forward: under adapter=lora the reference is the policy's own
routers with the adapters off, and its step-2 gradient equals a frozen copy's (before, its
forward stopped the routing pass, which then counted the reference's routing and stopped the
run at step 2: "routing not repeated").

The reference is computed here: test_dpo's sides and losses (transformers renders each side,
the papers' formulas), and the Switch loss from the router logits of the float64 policy's
forward of each side alone.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest
import torch

from tests.chat_support import make_tokenizer, write_jsonl
from tests.conftest import read_metrics, train_records
from tests.preference_support import pair_rows
from tests.ranks import explain, launch_all, torchrun_cmd
from tests.test_dpo import (
    DUMP,
    LORA,
    LR,
    MAX_LENGTH,
    PAIRS,
    TOL,
    TWO_STEPS,
    batch,
    data_args,
    losses,
    relative_error,
    sides,
    task_args,
)

pytest.importorskip("transformers")

EXPERTS, TOP_K, AUX = 4, 2, 0.01  # AUX: the in-tree objective's moe.aux_coef (Switch's)
MOE = [f"+model.moe.experts={EXPERTS}", f"+model.moe.top_k={TOP_K}"]
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dpo_moe")
    tok = make_tokenizer(root / "tok")
    train_file = write_jsonl(root / "pairs.jsonl", pair_rows(PAIRS, seed=5))
    val_file = write_jsonl(root / "val.jsonl", pair_rows(2, seed=6))  # all 8 pairs train
    args = data_args(root, train_file, val_file)

    def two_steps(name: str, split: list[str], nproc: int = 1, *extra: str) -> list[str]:
        dump = [f"+callbacks.dump._target_={DUMP}", f"+callbacks.dump.path={root / name}.pt"]
        launcher = torchrun_cmd(nproc) if nproc > 1 else [sys.executable]
        return [
            *launcher,
            "-m",
            "trainer.train",
            *args,
            *MOE,
            *task_args("sigmoid"),
            *TWO_STEPS,
            *split,
            *dump,
            "+callbacks.dump.step=2",
            *extra,
            f"hydra.run.dir={root / name}",
        ]

    cmds = {
        "accum": two_steps("accum", batch(2)),
        "packed": two_steps("packed", batch(2), 1, "data.packed=true"),
        "ddp": two_steps("ddp", batch(2, 2), 2),
        # The reference is the policy's own routers and experts, adapters off; or a copy.
        "lora_adapter": two_steps("lora_adapter", batch(2), 1, *LORA),
        "lora_copy": two_steps("lora_copy", batch(2), 1, *LORA, "task.reference=copy"),
    }
    procs = launch_all(cmds, TIMEOUT)
    pairs = [sides(tok, r) for r in pair_rows(PAIRS, seed=5)]
    return {"root": root, "procs": procs, "pairs": pairs}


def counted_positions(side: tuple[list[int], list[int]]) -> int:
    """The positions of a side the balancing counts: up to the one that predicts its last
    answer token (position t predicts token t + 1)."""
    ids, mask = side
    return max(t for t in range(len(ids) - 1) if mask[t + 1]) + 1


def switch_aux(logits: list[torch.Tensor], pairs: list[Any], layers: int) -> torch.Tensor:
    """The whole batch's Switch loss, E sum_i f_i P_i per layer, averaged over the layers:
    `logits` the router's (positions, E) of every side's forward, layer by layer."""
    counted = [counted_positions(s) for pair in pairs for s in pair]
    per_layer = []
    for layer in range(layers):
        rows = torch.cat([lg[:n] for lg, n in zip(logits[layer::layers], counted, strict=True)])
        probs = rows.softmax(-1)  # (tokens, E)
        chosen = probs.topk(TOP_K, dim=-1).indices
        f = torch.bincount(chosen.flatten(), minlength=EXPERTS).double() / chosen.numel()
        per_layer.append(EXPERTS * (f * probs.mean(0)).sum())
    return torch.stack(per_layer).mean()


def reference(pairs: list[Any], coef: float = AUX) -> dict[str, Any]:
    """Two float64 SGD steps of mean DPO + `coef` x aux over all the pairs at once, from the
    runs' initial model (the trainer's seed): the step-2 gradient, each step's records."""
    from trainer.models.gpt import GPT

    torch.manual_seed(1337)  # the trainer's seed, right before it builds the model
    policy = GPT(
        vocab_size=320,
        block_size=MAX_LENGTH,
        n_layer=2,
        n_head=2,
        n_embd=32,
        moe=dict(experts=EXPERTS, top_k=TOP_K),
    ).double()
    ref = copy.deepcopy(policy).requires_grad_(False)
    logits: list[torch.Tensor] = []
    for router in policy.routers():  # the policy's alone: the copy has no hook
        router.gate.register_forward_hook(lambda m, a, out: logits.append(out))
    out: dict[str, Any] = {}
    for step in (1, 2):
        policy.zero_grad()
        logits.clear()
        per_pair, rewards = losses("sigmoid", policy, ref, pairs)
        aux = switch_aux(logits, pairs, len(policy.routers()))
        (per_pair.mean() + coef * aux).backward()
        out[step] = {"loss": float(per_pair.detach().mean()), "moe_aux_loss": float(aux), **rewards}
        out["grads"] = {n: p.grad.clone() for n, p in policy.named_parameters()}
        with torch.no_grad():
            for p in policy.parameters():
                p -= LR * p.grad
    return out


@pytest.fixture(scope="module")
def want(runs: dict[str, Any]) -> dict[str, Any]:
    out = reference(runs["pairs"])
    out["unbalanced"] = reference(runs["pairs"], coef=0.0)["grads"]
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["accum", "packed", "ddp"])
def test_second_step_is_the_float64_dpo_and_balancing_gradient(
    name: str, runs: dict[str, Any], want: dict[str, Any]
) -> None:
    proc = runs["procs"][name]
    assert proc.returncode == 0, explain(proc)
    got = torch.load(runs["root"] / f"{name}.pt", weights_only=True)
    error = relative_error(got, want["grads"])
    assert error <= TOL, (name, error)
    # The balancing is in it: the same gradient without it is far outside the tolerance.
    assert relative_error(want["unbalanced"], want["grads"]) > 100 * TOL
    records = {r["step"]: r for r in train_records(read_metrics(runs["root"] / name))}
    for step in (1, 2):
        expected = want[step]
        got_records = {k: records[step][f"train/{k}"] for k in expected}
        assert got_records == pytest.approx(expected, rel=1e-4, abs=1e-6), (name, step)
    assert records[2]["train/reward_margin"] != 0.0


@pytest.mark.multiproc
def test_the_reference_of_the_policys_own_routers_is_not_counted(runs: dict[str, Any]) -> None:
    """adapter=lora: the reference runs the policy's routers with the adapters off. Its
    step-2 gradient (the adapters') equals that of a frozen copy of the initial model, whose
    routers are its own (LoRA's B starts at 0: the base is the initial model)."""
    procs, root = runs["procs"], runs["root"]
    for name in ("lora_adapter", "lora_copy"):
        assert procs[name].returncode == 0, explain(procs[name])
    adapter = torch.load(root / "lora_adapter.pt", weights_only=True)
    frozen = torch.load(root / "lora_copy.pt", weights_only=True)
    assert adapter and all("lora_" in n for n in adapter), sorted(adapter)
    assert any(".router." in n for n in adapter), sorted(adapter)  # the routers adapt too
    assert relative_error(adapter, {n: g.double() for n, g in frozen.items()}) <= TOL
    records = {r["step"]: r for r in train_records(read_metrics(root / "lora_adapter"))}
    assert abs(records[2]["train/reward_chosen"]) > 1e-8
