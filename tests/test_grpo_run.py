"""task=grpo through the real trainer (data=prompts, rollouts from the in-tree GPT, rewards):
each optimizer step applies the float64 gradient of its whole batch's objective, as
tests/test_grpo.py's reference computes it from the DAPO / Dr. GRPO / GRPO definitions
(within 1e-5 relative), for each loss type with mu = 1 and 2 and beta = 0 and > 0 (a frozen
copy), as one micro-batch of completions and as micro-batches of 2 x accumulation; on 2 DDP
ranks and 2 FSDP2 ranks too. The rollouts (tokens) of step 1 are the same on every layout;
the records are the exact means over the step's completions; a run killed with SIGKILL within a
rollout batch's iterations resumes bit for bit; bad input is one paragraph naming its key.

The steps' parameters, gradients and rollouts are captured by tests/grpo_run_support.py's
callback; the reference recomputes every log-probability from them in float64.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.chat_support import make_tokenizer, write_jsonl
from tests.conftest import read_metrics, train_in_process, train_records
from tests.grpo_run_support import GPT_ARGS, MODEL
from tests.prompts_support import prompt_rows
from tests.ranks import explain, launch_all, python_cmd, torchrun
from tests.test_grpo import Case, all_log_probs, reference_gradient, relative_error
from trainer.config.errors import UserError
from trainer.models.gpt import GPT
from trainer.rollout.rewards import RewardFailed

TOL = 1e-5
WEIGHTS = torch.tensor([1.0, 0.5], dtype=torch.float64)
TIMEOUT = 240


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grpo_run")
    make_tokenizer(root / "tok")
    return {
        "tok": root / "tok",
        "prompts": write_jsonl(root / "p.jsonl", prompt_rows(40)),
        "cache": root / "cache",
    }


def args(files: dict[str, Path], out: Path, *more: str) -> list[str]:
    """A 2-step SGD run on 4 prompts x 4 completions per step, the captures in `out`."""
    return [
        *MODEL,
        "logger=none",
        "data=prompts",
        f"data.path={files['prompts']}",
        f"data.tokenizer={files['tok']}",
        f"data.cache_dir={files['cache']}",
        "data.tokenize_workers=1",
        "task=grpo",
        "task.num_generations=4",
        "task.epsilon=0.05",
        "task.epsilon_high=0.08",
        "task.max_new_tokens=6",
        "reward=[exact_answer,format]",
        "reward.funcs.format.pattern=.*e",  # random text holds an e about half the time
        "reward.weights.format=0.5",
        "optim=sgd",
        "optim.lr=3.0",
        "optim.momentum=0.0",
        "scheduler=constant",
        "train.clip_grad_norm=null",
        "train.micro_batch_size=2",
        "train.grad_accum_steps=2",
        "train.max_steps=2",
        "train.log_every=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "+callbacks.capture._target_=tests.grpo_run_support.CaptureSteps",
        f"+callbacks.capture.out={out}",
        *more,
    ]


def groups_of(saved: dict[str, Any]) -> list[Any]:
    from engine.rl.rollouts import Group

    return [Group(**g) for g in saved["groups"]]


def check_steps(out: Path, case: Case, mu: int) -> tuple[list[Any], dict[str, float]]:
    """Both steps' gradients against the float64 whole-batch gradient; step 1's groups and
    the reference's records of step 2."""
    template = GPT(**GPT_ARGS)
    one, two = (torch.load(out / f"step{s}.pt") for s in (1, 2))
    first, second = groups_of(one), groups_of(two)
    ref = all_log_probs(one["params"], first, template) if case.beta else None
    want1, _ = reference_gradient(one["params"], first, case, None, ref, template)
    err = relative_error(one["grads"], want1)
    assert err < TOL, f"step 1: relative error {err:.2e}"
    if mu == 2:  # step 2 trains on step 1's rollouts, their log-probabilities the old policy's
        assert all(torch.equal(a.completions, b.completions) for a, b in zip(first, second))
        old = all_log_probs(one["params"], first, template)
    else:
        assert not all(torch.equal(a.prompt, b.prompt) for a, b in zip(first, second))
        old = None
    ref = all_log_probs(one["params"], second, template) if case.beta else None
    want2, records = reference_gradient(two["params"], second, case, old, ref, template)
    err = relative_error(two["grads"], want2)
    assert err < TOL, f"step 2: relative error {err:.2e}"
    return first, records


def check_records(records: list[dict[str, Any]], groups: list[Any]) -> None:
    """Step 1's rollout records: exact means over its completions."""
    rewards = [[float(WEIGHTS @ r) for r in g.rewards] for g in groups]
    flat = [x for r in rewards for x in r]
    lengths = [int(n) for g in groups for n in g.lengths]
    step1 = train_records(records)[0]
    assert step1["train/reward"] == pytest.approx(sum(flat) / len(flat), rel=1e-12)
    assert step1["train/completion_len"] == pytest.approx(sum(lengths) / len(lengths))
    assert step1["train/completion_len_max"] == max(lengths)
    assert step1["train/zero_std_groups"] == sum(max(r) == min(r) for r in rewards)
    assert step1["time/generate_s"] > 0


# (loss_type, mu, beta, completions per micro-batch: 16 is the whole window)
CASES = [
    ("dapo", 2, 0.2, 2),
    ("dapo", 1, 0.0, 16),
    ("grpo", 2, 0.0, 16),
    ("grpo", 1, 0.2, 2),
    ("dr_grpo", 2, 0.2, 16),
    ("dr_grpo", 1, 0.0, 2),
]
STEP1: dict[str, list[Any]] = {}  # each run's step-1 rollouts, compared across layouts


@pytest.mark.parametrize(("loss_type", "mu", "beta", "micro"), CASES)
def test_each_step_is_the_float64_whole_batch_gradient(
    files: dict[str, Path], tmp_path: Path, loss_type: str, mu: int, beta: float, micro: int
) -> None:
    out = tmp_path / "steps"
    overrides = [
        f"task.loss_type={loss_type}",
        f"task.num_iterations={mu}",
        f"task.beta={beta}",
        f"rollout.micro_batch_size={micro}",
    ]
    records = train_in_process(args(files, out, *overrides), tmp_path / "run")
    case = Case(loss_type, beta, mask_truncated=False, weights=WEIGHTS)
    first, want = check_steps(out, case, mu)
    check_records(records, first)
    step2 = train_records(records)[1]
    assert step2["train/clip_ratio"] == pytest.approx(want["clip_ratio"], abs=1e-12)
    assert step2["train/entropy"] == pytest.approx(want["entropy"], rel=1e-5)
    if beta:
        assert step2["train/kl"] == pytest.approx(want["kl"], rel=1e-4)
    if mu == 2:
        assert want["clip_ratio"] > 0  # the old policy is step 1's: it really clips
    STEP1[f"{loss_type}-{mu}"] = first


@pytest.mark.multiproc
def test_two_ranks_ddp_and_fsdp2_apply_the_whole_batch_gradient(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """DDP (batch scaling all-reduced, beta > 0, mu = 2) and FSDP2 (grpo, mu = 1) on 2 gloo
    ranks of 2 prompts each: the float64 whole batch's gradients, and step 1's rollouts the
    same tokens as one process's."""
    layouts = {
        "ddp": (
            "dapo",
            2,
            0.2,
            ["task.scale_rewards=batch", "rollout.micro_batch_size=2"],
        ),
        "fsdp": ("grpo", 1, 0.0, ["dist.strategy=fsdp"]),
    }
    cmds = {
        name: torchrun(
            2,
            [
                *args(files, tmp_path / name, *more),
                f"task.loss_type={loss}",
                f"task.num_iterations={mu}",
                f"task.beta={beta}",
                "train.grad_accum_steps=1",
                f"hydra.run.dir={tmp_path / (name + '_run')}",
            ],
        )
        for name, (loss, mu, beta, more) in layouts.items()
    }
    one = python_cmd(
        "trainer.train",
        *args(files, tmp_path / "one"),
        f"hydra.run.dir={tmp_path / 'one_run'}",
        "train.max_steps=1",
    )
    results = launch_all({**cmds, "one": one}, TIMEOUT)
    for proc in results.values():
        assert proc.returncode == 0, explain(proc)
    alone = groups_of(torch.load(tmp_path / "one" / "step1.pt"))
    for name, (loss, mu, beta, more) in layouts.items():
        scale = "batch" if "task.scale_rewards=batch" in more else "group"
        case = Case(loss, beta, mask_truncated=False, scale=scale, weights=WEIGHTS)
        first, _ = check_steps(tmp_path / name, case, mu)
        assert len(first) == len(alone) == 4
        for a, b in zip(first, alone):
            assert torch.equal(a.prompt, b.prompt) and torch.equal(a.completions, b.completions)
            assert torch.equal(a.rewards, b.rewards)
        check_records(read_metrics(tmp_path / (name + "_run")), first)
    for runs in STEP1.values():  # the in-process runs' too (other loss types: same rollouts)
        assert all(torch.equal(a.completions, b.completions) for a, b in zip(runs, alone))


@pytest.mark.launches
def test_sigkill_within_a_rollout_batch_resumes_bit_for_bit(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """mu = 2, beta > 0, checkpoints every step: killed after step 4, the rerun resumes from
    step 3's checkpoint (within the batch of steps 3-4: it holds the rollouts and their old
    log-probabilities) and its records equal an uninterrupted run's bit for bit."""
    common = [
        "task.num_iterations=2",
        "task.beta=0.2",
        "train.max_steps=5",
        "checkpoint.every_steps=1",
        "optim.lr=0.5",
    ]
    marker = tmp_path / "kill.marker"
    kill = [
        "+callbacks.kill._target_=tests.ckpt_support.KillOnce",
        "+callbacks.kill.step=4",
        f"+callbacks.kill.marker={marker}",
    ]
    cmds = {
        "whole": python_cmd(
            "trainer.train",
            *args(files, tmp_path / "w"),
            *common,
            f"hydra.run.dir={tmp_path / 'whole'}",
        ),
        "killed": python_cmd(
            "trainer.train",
            *args(files, tmp_path / "k"),
            *common,
            *kill,
            f"hydra.run.dir={tmp_path / 'killed'}",
        ),
    }
    results = launch_all(cmds, TIMEOUT)
    assert results["whole"].returncode == 0, explain(results["whole"])
    assert results["killed"].returncode == -9, explain(results["killed"])
    again = launch_all({"rerun": cmds["killed"]}, TIMEOUT)["rerun"]
    assert again.returncode == 0, explain(again)
    assert "resum" in again.stdout.lower(), again.stdout
    keys = ("train/loss", "train/grad_norm", "train/reward", "train/clip_ratio", "train/kl")
    want = [
        (r["step"], *[r[k] for k in keys]) for r in train_records(read_metrics(tmp_path / "whole"))
    ]
    got = [
        (r["step"], *[r[k] for k in keys]) for r in train_records(read_metrics(tmp_path / "killed"))
    ]
    assert [g[0] for g in got] == [1, 2, 3, 4, 5]
    assert got == want
    assert want[3][4] > 0  # step 4 reuses step 3's rollouts: its ratio moved off 1


# --------------------------------------------------------------------------- bad input


def wrong_count(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0] * (len(completions) + 1)


def not_a_number(completions: list[Any], **kwargs: Any) -> list[Any]:
    return ["high"] * len(completions)


def raises_on_some(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    return [1.0 / (int(a) % 2) for a in answer]  # an even answer divides by zero


BAD = [
    (["task.num_generations=1"], "task.num_generations", "at least 2"),
    (["task.max_new_tokens=200"], "data.max_new_tokens", "do not fit"),
    (["data.max_new_tokens=8"], "data.max_new_tokens", "set task.max_new_tokens alone"),
    (["task.temperature=-1"], "task.temperature", "must be >= 0"),
    (["task.top_p=0"], "task.top_p", "must be in (0, 1]"),
    (["model.block_size=40"], "data.path", "leave no room for the completion"),
    (
        ["+reward.funcs.bad._target_=tests.test_grpo_run.wrong_count"],
        "reward.funcs.bad (bad) returned 5 scores for 4 completions",
        "one score",
    ),
    (
        ["+reward.funcs.bad._target_=tests.test_grpo_run.not_a_number"],
        "returned 'high' (str)",
        "a finite number",
    ),
]


@pytest.mark.parametrize(("overrides", "names", "says"), BAD)
def test_bad_input_is_one_paragraph(
    files: dict[str, Path], tmp_path: Path, overrides: list[str], names: str, says: str
) -> None:
    with pytest.raises(UserError) as err:
        train_in_process([*args(files, tmp_path / "c"), "train.max_steps=1", *overrides], tmp_path)
    text = str(err.value)
    assert names in text and says in text, text
    assert "\n" not in text


def test_a_raising_reward_shows_its_row_and_traceback_once(
    files: dict[str, Path], tmp_path: Path
) -> None:
    extra = ["+reward.funcs.bad._target_=tests.test_grpo_run.raises_on_some", "train.max_steps=1"]
    with pytest.raises(RewardFailed) as err:
        train_in_process([*args(files, tmp_path / "c"), *extra], tmp_path)
    head, _, frames = str(err.value).partition("\n\n")
    assert "reward.funcs.bad (bad) raised ZeroDivisionError" in head and "'answer':" in head
    assert frames.count("Traceback") == 1 and "raises_on_some" in frames


def test_prompts_without_a_field_a_reward_reads(files: dict[str, Path], tmp_path: Path) -> None:
    rows = [{k: v for k, v in r.items() if k != "answer"} for r in prompt_rows(20)]
    bare = write_jsonl(tmp_path / "bare.jsonl", rows)
    with pytest.raises(UserError) as err:
        train_in_process([*args(files, tmp_path / "c"), f"data.path={bare}"], tmp_path / "r")
    text = str(err.value)
    assert text.startswith("data.path:") and "'answer'" in text and "exact_answer" in text


def greedy(model: GPT, prompt: torch.Tensor, steps: int) -> list[int]:
    """The argmax continuation of `prompt`, `steps` tokens, by the model's plain forward."""
    ids = prompt[None]
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids)[:, -1].argmax(-1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_task_temperature_and_max_new_tokens_take_effect(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """task.temperature=0 generates greedily (every completion of a group is the model's
    argmax continuation, computed here from the step's parameters) and task.max_new_tokens=3
    caps them; task.temperature=1 samples (a group's completions differ)."""
    drawn = {}
    for temperature in (0, 1):
        out = tmp_path / f"t{temperature}"
        more = ["train.max_steps=1", "task.max_new_tokens=3", f"task.temperature={temperature}"]
        train_in_process([*args(files, out), *more], tmp_path / f"r{temperature}")
        drawn[temperature] = saved = torch.load(out / "step1.pt")
        assert all(g.completions.shape[1] <= 3 for g in groups_of(saved))
        assert max(int(g.lengths.max()) for g in groups_of(saved)) == 3
    model = GPT(**GPT_ARGS)
    model.load_state_dict(drawn[0]["params"])
    model.eval()
    for g in groups_of(drawn[0]):
        want = greedy(model, g.prompt, 3)
        for row, n in zip(g.completions, g.lengths):
            assert row[: int(n)].tolist() == want[: int(n)]
    assert any(len({tuple(r.tolist()) for r in g.completions}) > 1 for g in groups_of(drawn[1]))


def test_the_capture_is_what_the_run_records(files: dict[str, Path], tmp_path: Path) -> None:
    """The records' keys of a GRPO step, and its evaluation's."""
    evaluate = ["train.max_steps=1", "eval.every_steps=1", "eval.max_batches=1"]
    records = train_in_process([*args(files, tmp_path / "c"), *evaluate], tmp_path)
    step = train_records(records)[0]
    (val,) = [r for r in records if "val/loss" in r]  # one greedy completion per prompt
    assert val["val/loss"] == -val["val/reward"] and "val/reward/format" in val
    for key in (
        "reward",
        "reward_std",
        "reward/exact_answer",
        "reward/format",
        "completion_len",
        "completion_len_max",
        "clip_ratio",
        "entropy",
        "zero_std_groups",
    ):
        assert f"train/{key}" in step, key
    assert "train/kl" not in step  # beta = 0
    json.dumps(step)


def lora_template() -> Any:
    """The run's GPT with peft's adapters on every linear layer but the output layer
    (configs/adapter/lora.yaml: r 16, alpha 32), injected in place as the trainer does."""
    import peft

    model = GPT(**GPT_ARGS)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    targets = [n for n in names if n != "lm_head"]
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets)
    peft.get_peft_model(model, config)
    return model


def adapter_gradient(params: dict, groups: list, case: Case, old: Any, ref: Any) -> dict:
    """The float64 whole-batch gradient with respect to the adapters (the base frozen)."""
    from tests.test_grpo import reference_objective

    model64 = lora_template().double()
    model64.load_state_dict({k: v.double() for k, v in params.items()})
    objective, _ = reference_objective(model64, groups, case, old, ref)
    objective.backward()
    return {n: p.grad for n, p in model64.named_parameters() if p.requires_grad}


def test_lora_with_the_adapter_reference(files: dict[str, Path], tmp_path: Path) -> None:
    """adapter=lora, beta > 0 against the base with its adapters disabled, mu = 2: both steps
    apply the float64 whole-batch gradient of the adapters (the base gets none)."""
    out = tmp_path / "steps"
    extra = ["adapter=lora", "task.beta=0.2", "task.num_iterations=2", "rollout.micro_batch_size=4"]
    train_in_process(args(files, out, *extra), tmp_path / "run")
    one, two = (torch.load(out / f"step{s}.pt") for s in (1, 2))
    groups = groups_of(one)
    assert all(".lora_" in n for n in one["grads"]) and one["grads"]
    case = Case("dapo", 0.2, mask_truncated=False, weights=WEIGHTS)
    template = lora_template()
    base = all_log_probs(one["params"], groups, template)  # B = 0: the base's own
    want1 = adapter_gradient(one["params"], groups, case, None, base)
    assert relative_error(one["grads"], want1) < TOL
    want2 = adapter_gradient(two["params"], groups, case, base, base)
    assert relative_error(two["grads"], want2) < TOL


def test_preview_shows_each_prompt_its_completions_rewards_and_advantages(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """trainer.preview with task=grpo: per prompt its G completions, each with its weighted
    reward, each function's score and its advantage (the group's advantages sum to 0)."""
    from trainer.preview import main

    run = [a for a in args(files, tmp_path / "c") if "callbacks.capture" not in a]
    main([*run, "preview.samples=3"])
    out = capsys.readouterr().out.strip().splitlines()
    stats = json.loads(out[-1])
    assert stats["prompts"] == 3 and stats["completions"] == 12
    shown = [line for line in out if line.startswith("  [")]
    assert len(shown) == 12 and all("exact_answer" in s and "format" in s for s in shown)
    for k in range(3):
        adv = [float(s.split("advantage ")[1].split(" ")[0]) for s in shown[4 * k : 4 * k + 4]]
        assert abs(sum(adv)) < 1e-2
