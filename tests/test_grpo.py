"""task=grpo's loss is exact: given a step's rollouts, the gradient that one SGD step of the
real accumulation step (engine/steps/accumulate.py) applies equals the float64 gradient of the
whole-batch objective, within 1e-5 relative, for each loss type (dapo, grpo, dr_grpo), for one
iteration per rollout batch (fresh rollouts at step 2) and two (step 2 trains on step 1's
rollouts with step 1's log-probabilities as the old policy, and clips), without and with the
k3 KL to a frozen copy of the initial model (beta > 0), as one micro-batch and as micro-batches
of 2 completions x accumulation, on the log-probabilities from the GPT's hidden states and from
its logits; on 2 gloo ranks (groups split over the ranks, `batch` scaling all-reduced) too.
The records are the exact means over the step's completions and loss tokens. From data=prompts
through generate_rollouts (the in-tree GPT generating, TRL-signature rewards scoring), the
rollouts do not depend on how the prompts were batched and train as the reference says.

The reference is written here from the papers' definitions (DAPO arXiv 2503.14476, Dr. GRPO
arXiv 2503.20783, DeepSeekMath's GRPO): each completion scored alone (its prompt and its
tokens, no padding) by a float64 copy of the model, the advantages from the group's mean and
Bessel std (+ 1e-4, TRL's), the clipped surrogate, the k3 estimator, and the global
denominators (all loss tokens; the completions with a loss token; N x L_max).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from engine.callbacks import Callback
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.preference import frozen_copy
from engine.rl.advantages import group_advantages
from engine.rl.grpo import GRPOTask, grpo_records
from engine.rl.rollouts import Group, completion_batches, rollout_sums, weighted_rewards
from engine.step import CallbackList, StepContext
from engine.steps.accumulate import AccumulateStep
from tests.grpo_support import (
    EPS,
    EPS_HIGH,
    L_MAX,
    LR,
    PROMPTS,
    TWO_RANKS,
    G,
    make_groups,
    tiny_gpt,
    weights,
)
from tests.ranks import explain, launch, torchrun_cmd
from trainer.models.gpt import GPT

TOL = 1e-5
# The head route: the GPT's 64 classes over the threshold, log-probabilities from its hidden
# states 8 tokens at a time; the logits route: read from its logits 8 positions at a time.
ROUTES = {"head": (8, 32), "logits": (8, 1024)}
WEIGHTS = weights()


def reference_advantages(
    groups: Sequence[Group], scale: str, weights: torch.Tensor = WEIGHTS
) -> list[list[float]]:
    """A_i from the definitions, in float64 Python numbers."""
    totals = [[float(weights @ r) for r in g.rewards] for g in groups]
    flat = [x for t in totals for x in t]
    batch_mean = sum(flat) / len(flat)
    batch_std = (sum((x - batch_mean) ** 2 for x in flat) / (len(flat) - 1)) ** 0.5
    out = []
    for t in totals:
        mean = sum(t) / len(t)
        std = (sum((x - mean) ** 2 for x in t) / (len(t) - 1)) ** 0.5
        if max(t) == min(t):
            out.append([0.0] * len(t))
            continue
        div = {"group": std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
        out.append([(x - mean) / div for x in t])
    return out


# --------------------------------------------------------------------------- the reference


def completion_scores(
    model: nn.Module, prompt: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p of each of `tokens` after `prompt`, and the entropy of each of their
    distributions: the row alone (float64 model)."""
    row = torch.cat([prompt, tokens])[None]
    logp = model(row)[0].log_softmax(-1)  # (T, V)
    p = len(prompt)
    at = logp[p - 1 : p - 1 + len(tokens)]  # (n, V)
    entropy = -(at.exp() * at).sum(-1).detach()
    return at.gather(-1, tokens[:, None]).squeeze(-1), entropy


def completion_log_probs(
    model: nn.Module, prompt: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    return completion_scores(model, prompt, tokens)[0]


@dataclass
class Case:
    loss_type: str
    beta: float
    mask_truncated: bool = True
    scale: str = "group"
    weights: torch.Tensor = WEIGHTS


def reference_objective(
    model64: nn.Module,
    groups: Sequence[Group],
    case: Case,
    old: list[list[torch.Tensor]] | None,
    ref: list[list[torch.Tensor]] | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The whole batch's loss (the papers' objective, negated) and its token records."""
    adv = reference_advantages(groups, case.scale, case.weights)
    numer, seq_means, kept, tokens = [], [], 0, 0
    clipped = kl_sum = entropy = 0.0
    n_completions = sum(g.size for g in groups)
    for g, group in enumerate(groups):
        for i in range(group.size):
            n = int(group.lengths[i])
            if case.mask_truncated and bool(group.truncated[i]):
                continue
            lp, h = completion_scores(model64, group.prompt, group.completions[i, :n])
            entropy += float(h.sum())
            lp_old = lp.detach() if old is None else old[g][i]
            ratio = torch.exp(lp - lp_old)
            a = adv[g][i]
            loss = -torch.minimum(ratio * a, ratio.clamp(1 - EPS, 1 + EPS_HIGH) * a)
            if case.beta > 0:
                assert ref is not None
                delta = ref[g][i] - lp
                kl = torch.exp(delta) - delta - 1
                loss = loss + case.beta * kl
                kl_sum += float(kl.detach().sum())
            clipped += float(
                (((ratio < 1 - EPS) & (a < 0)) | ((ratio > 1 + EPS_HIGH) & (a > 0))).sum()
            )
            numer.append(loss.sum())
            seq_means.append(loss.sum() / n)
            kept += 1
            tokens += n
    if case.loss_type == "dapo":
        objective = torch.stack(numer).sum() / tokens
    elif case.loss_type == "grpo":
        objective = torch.stack(seq_means).sum() / kept
    else:
        objective = torch.stack(numer).sum() / (n_completions * L_MAX)
    records = {"clip_ratio": clipped / tokens, "entropy": entropy / tokens}
    if case.beta:
        records["kl"] = kl_sum / tokens
    return objective, records


def reference_gradient(
    params: dict[str, torch.Tensor],
    groups: Sequence[Group],
    case: Case,
    old: list[list[torch.Tensor]] | None,
    ref: list[list[torch.Tensor]] | None,
    template: nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    model64 = copy.deepcopy(template).double()
    model64.load_state_dict({k: v.double() for k, v in params.items()})
    model64.zero_grad()
    objective, records = reference_objective(model64, groups, case, old, ref)
    objective.backward()
    grads = {n: p.grad.detach().clone() for n, p in model64.named_parameters()}
    return grads, records


def all_log_probs(params: dict[str, torch.Tensor], groups: Sequence[Group], template: nn.Module):
    """Every completion's log-probabilities (float64, detached) under `params`."""
    model64 = copy.deepcopy(template).double()
    model64.load_state_dict({k: v.double() for k, v in params.items()})
    with torch.no_grad():
        return [
            [
                completion_log_probs(model64, g.prompt, g.completions[i, : int(g.lengths[i])])
                for i in range(g.size)
            ]
            for g in groups
        ]


# --------------------------------------------------------------------------- the engine side


class StepCapture(Callback):
    """The gradients the optimizer is about to apply (after the window, clipping off)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        self.grads.append(
            {
                n: p.grad.detach().clone()
                for n, p in ctx.model.named_parameters()
                if p.grad is not None
            }
        )


class KeepsOutputs:
    """The integration's thin layer, as a test sees it: `loss_sum` from `loss_and_sums`, the
    sums and the log-probabilities kept per micro-batch (in order)."""

    def __init__(self, task: GRPOTask) -> None:
        self.task = task
        self.outputs: list[Any] = []

    def count_items(self, batch: Any) -> torch.Tensor:
        return self.task.count_items(batch)

    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        out = self.task.loss_and_sums(model, batch)
        self.outputs.append(out)
        return out.loss_sum


def model_and_task(case: Case, route: str) -> tuple[GPT, KeepsOutputs]:
    model = tiny_gpt()
    chunk, threshold = ROUTES[route]
    reference = frozen_copy(model) if case.beta > 0 else None
    task = GRPOTask(
        max_new_tokens=L_MAX,
        loss_type=case.loss_type,
        epsilon=EPS,
        epsilon_high=EPS_HIGH,
        beta=case.beta,
        reference=reference,
        chunk_size=chunk,
        chunked_vocab_threshold=threshold,
    )
    return model, KeepsOutputs(task)


def window(groups: Sequence[Group], case: Case, micro: int, old: list | None = None) -> list[dict]:
    rewards = weighted_rewards(groups, WEIGHTS)
    adv = group_advantages(rewards, case.scale).values
    batches = completion_batches(groups, adv, micro, case.mask_truncated)
    if old is None:
        return batches
    # The kept log-probabilities of step 1's micro-batches: the same rows in the same order.
    return [{**b, "old_log_probs": o} for b, o in zip(batches, old)]


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    g = torch.cat([got[n].double().flatten() for n in want])
    w = torch.cat([want[n].flatten() for n in want])
    return float((g - w).norm() / w.norm())


CASES = [Case(loss, beta) for loss in ("dapo", "grpo", "dr_grpo") for beta in (0.0, 0.2)] + [
    Case("dapo", 0.0, mask_truncated=False),
    Case("dr_grpo", 0.2, scale="none"),
]


def ids(case: Case) -> str:
    extra = "" if case.mask_truncated else "-unmasked"
    return f"{case.loss_type}-beta{case.beta}-{case.scale}{extra}"


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("mu", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_second_step_is_the_float64_whole_batch_gradient(case: Case, mu: int, route: str) -> None:
    """Two SGD steps as one micro-batch and as micro-batches of 2 completions; each step's
    gradient equals the float64 gradient of its whole-batch objective."""
    first = make_groups(11, PROMPTS[:3], equal_group=1)
    second = first if mu == 2 else make_groups(12, (4, 2, 6), equal_group=None)
    n_completions = sum(g.size for g in first)
    results = {}
    for micro in (n_completions, 2):
        model, keeper = model_and_task(case, route)
        template = copy.deepcopy(model)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        capture = StepCapture()
        ctx = StepContext(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            scheduler=None,
            task=keeper,  # type: ignore[arg-type]
            precision=Precision("fp32", "cpu"),
            dist=DistInfo(),
            clip_grad_norm=None,
            callbacks=CallbackList({"capture": capture}),
        )
        step = AccumulateStep()
        step(ctx, window(first, case, micro))
        kept = [o.log_probs for o in keeper.outputs]
        step1_sums = [o.sums for o in keeper.outputs]
        keeper.outputs.clear()
        after_one = {k: v.detach().clone() for k, v in model.state_dict().items()}
        step(ctx, window(second, case, micro, kept if mu == 2 else None))
        results[micro] = (capture.grads, initial, after_one, template, step1_sums, keeper.outputs)

    for micro, (grads, initial, after_one, template, step1_sums, outputs) in results.items():
        ref0 = all_log_probs(initial, first, template) if case.beta else None
        want1, _ = reference_gradient(initial, first, case, None, ref0, template)
        assert relative_error(grads[0], want1) < TOL, (micro, relative_error(grads[0], want1))
        old = all_log_probs(initial, first, template) if mu == 2 else None
        ref = all_log_probs(initial, second, template) if case.beta else None
        want2, records = reference_gradient(after_one, second, case, old, ref, template)
        err = relative_error(grads[1], want2)
        assert err < TOL, f"micro {micro}: step 2 relative error {err:.2e}"
        sums = {k: sum(float(o.sums[k]) for o in outputs) for k in outputs[0].sums}
        got = grpo_records(sums)
        if mu == 2:  # the old policy is step 1's: the second step really clips
            assert records["clip_ratio"] > 0.05, records
        assert got["clip_ratio"] == pytest.approx(records["clip_ratio"], abs=1e-12)
        assert got["entropy"] == pytest.approx(records["entropy"], rel=1e-5)
        if case.beta:
            assert records["kl"] > 0
            assert got["kl"] == pytest.approx(records["kl"], rel=1e-4)
        assert all(float(s["clip_ratio"]) == 0 for s in step1_sums)  # ratio 1 at step 1


def test_rollout_records_are_the_exact_means_over_the_completions() -> None:
    """rollout_sums over any split of the groups, summed, give the means over every
    completion: the weighted reward, each function's, the mean group std, lengths, truncated
    share, the count of zero-std groups and the longest completion."""
    groups = make_groups(11, PROMPTS, equal_group=1)
    names = ("first", "second")
    totals: dict[str, float] = {}
    longest = 0.0
    for part in (groups[:1], groups[1:3], groups[3:]):  # three "ranks"
        adv = group_advantages(weighted_rewards(part, WEIGHTS), "group")
        sums, maxima = rollout_sums(part, adv, WEIGHTS, names)
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        longest = max(longest, float(maxima["completion_len_max"]))
    got = grpo_records(totals, {"completion_len_max": longest})
    rewards = [[float(WEIGHTS @ r) for r in g.rewards] for g in groups]
    flat = [x for r in rewards for x in r]
    stds = [(sum((x - sum(r) / len(r)) ** 2 for x in r) / (len(r) - 1)) ** 0.5 for r in rewards]
    lengths = [int(n) for g in groups for n in g.lengths]
    assert got["reward"] == pytest.approx(sum(flat) / len(flat), rel=1e-12)
    assert got["reward_std"] == pytest.approx(sum(stds) / len(stds), rel=1e-12)
    for f, name in enumerate(names):
        mean = sum(float(r[f]) for g in groups for r in g.rewards) / len(flat)
        assert got[f"reward/{name}"] == pytest.approx(mean, rel=1e-12)
    assert got["completion_len"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-12)
    assert got["completion_len_max"] == max(lengths) == L_MAX
    assert got["truncated_ratio"] == pytest.approx(len(groups) / len(flat))
    assert got["zero_std_groups"] == 1.0  # group 1: all rewards equal, not an error


def test_a_group_of_equal_rewards_has_zero_advantage_and_none_scored_is_left_out() -> None:
    """All-equal rewards: advantage exactly 0 (not round-off) under every scaling; a completion
    no reward function scored (NaN) is out of its group's mean and std, advantage 0."""
    third = torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float64)  # 3 x 0.1 rounds
    for scale in ("group", "batch", "none"):
        adv = group_advantages(third, scale)
        assert adv.values.eq(0).all() and bool(adv.zero_std[0])
    nan = float("nan")
    adv = group_advantages(torch.tensor([[1.0, nan, 0.0, 2.0]], dtype=torch.float64), "group")
    assert adv.values[0, 1] == 0 and not bool(adv.zero_std[0])
    assert adv.values[0, 0] == pytest.approx(0.0) and adv.values[0, 3] == pytest.approx(1 / 1.0001)


@pytest.mark.multiproc
def test_two_ranks_apply_the_float64_whole_batch_gradient(tmp_path: Any) -> None:
    """2 DDP ranks on gloo, each every other group (batch scaling all-reduced), micro-batches
    of 2 completions, beta > 0, mu = 2: both steps' gradients are the whole batch's."""
    out = tmp_path / "two_ranks.pt"
    proc = launch([*torchrun_cmd(2), "-m", "tests.grpo_support", str(out)], timeout=120)
    assert proc.returncode == 0, explain(proc)
    got = torch.load(out)
    groups = make_groups(11, PROMPTS, equal_group=1)
    case = Case(TWO_RANKS["loss_type"], TWO_RANKS["beta"], scale=TWO_RANKS["scale"])
    template = tiny_gpt()
    initial = got["params"][0]
    ref = all_log_probs(initial, groups, template)
    want1, _ = reference_gradient(initial, groups, case, None, ref, template)
    assert relative_error(got["grads"][0], want1) < TOL
    want2, records = reference_gradient(got["params"][1], groups, case, ref, ref, template)
    assert relative_error(got["grads"][1], want2) < TOL
    assert records["clip_ratio"] > 0.05
    means = grpo_records(got["sums"], got["maxima"])
    assert means["clip_ratio"] == pytest.approx(records["clip_ratio"], abs=1e-12)
    assert means["entropy"] == pytest.approx(records["entropy"], rel=1e-5)
    assert means["kl"] == pytest.approx(records["kl"], rel=1e-4)
    assert means["zero_std_groups"] == 1.0


def test_rollouts_from_prompts_train_as_the_float64_reference(tmp_path: Any) -> None:
    """data=prompts -> generate_rollouts (the in-tree GPT, exact_answer and a format)
    -> one AccumulateStep: the rollouts do not depend on how the prompts were batched, and
    the step's gradient is the float64 gradient of the whole batch's objective."""
    from tests.chat_support import make_tokenizer, write_jsonl
    from tests.prompts_support import prompt_rows
    from trainer.data.prompts import collate_prompts, prompts_data
    from trainer.rollout.engines import RecomputeEngine
    from trainer.rollout.generate import RolloutPlan, generate_rollouts
    from trainer.rollout.rewards import build_rewards
    from trainer.rollout.sampling import Sampling

    make_tokenizer(tmp_path / "tok")
    rows = write_jsonl(tmp_path / "p.jsonl", prompt_rows(10))
    data = prompts_data(
        str(rows),
        tokenizer=str(tmp_path / "tok"),
        max_new_tokens=L_MAX,
        context=64,
        tokenize_workers=1,
        cache_dir=str(tmp_path / "c"),
    )
    prompts = data.train
    rewards = build_rewards(
        [
            {"_target_": "trainer.rollout.rewards.exact_answer"},
            {
                "_target_": "trainer.rollout.rewards.format_match",
                "pattern": ".*e",  # random text holds an e about half the time
                "weight": 0.5,
            },
        ]
    )
    sampling = Sampling(L_MAX, prompts.end_ids, temperature=1.0)
    # A random model seldom ends a completion: the truncated ones train too.
    plan = RolloutPlan(G, sampling, micro_batch_size=2, mask_truncated=False)
    torch.manual_seed(0)
    model = GPT(vocab_size=320, block_size=64, n_layer=2, n_head=2, n_embd=16)
    samples = [prompts[i] for i in range(4)]

    def rollouts(window: list) -> Any:
        return generate_rollouts(
            model,
            RecomputeEngine(),
            window,
            prompts.row,
            prompts.decode_text,
            rewards,
            plan,
            seed=5,
            step=1,
        )

    whole = rollouts([collate_prompts(samples)])
    split = rollouts([collate_prompts(samples[:1]), collate_prompts(samples[1:])])
    for a, b in zip(whole.groups, split.groups):
        assert torch.equal(a.completions, b.completions) and torch.equal(a.rewards, b.rewards)
    assert torch.equal(whole.advantages.values, split.advantages.values)
    assert whole.advantages.values.abs().sum() > 0  # rewards that differ within groups

    task = GRPOTask(
        L_MAX,
        num_generations=G,
        loss_type="grpo",
        epsilon=EPS,
        epsilon_high=EPS_HIGH,
        chunk_size=8,
        chunked_vocab_threshold=32,
    )
    template = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    capture = StepCapture()
    ctx = StepContext(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        scheduler=None,
        task=task,
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        callbacks=CallbackList({"capture": capture}),
    )
    AccumulateStep()(ctx, whole.batches)
    case = Case("grpo", 0.0, mask_truncated=False, weights=rewards.weights)
    want, _ = reference_gradient(initial, whole.groups, case, None, None, template)
    assert relative_error(capture.grads[0], want) < TOL
