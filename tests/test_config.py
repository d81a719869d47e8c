"""Every shipped config composes, validates and builds the component it configures.

The config files are discovered from `configs/<group>/`, so a new file is covered without
touching this module; a new *group* fails `test_every_group_has_a_builder_check` until a
builder check is added below.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import default_collate

from engine.callbacks import CallbackList
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.step import StepContext, StepResult, Task
from tests.conftest import CONFIG_DIR, compose_config
from trainer.config.cli import to_config
from trainer.config.errors import ConfigError, UserError
from trainer.config.schema import Config
from trainer.data import DataSplits
from trainer.rollout.task import GRPORunTask
from trainer.run.assemble import build_data, build_model, build_task, check_fits
from trainer.run.build import build_callbacks, build_step
from trainer.run.extensions.adapter import build_adapter
from trainer.run.extensions.preference import attach_reference
from trainer.run.optim import build_optimizer, build_scheduler

CPU = torch.device("cpu")
SMALL_MODEL = "model=gpt_tiny"


# --------------------------------------------------------------------------- discovery


def _groups() -> list[str]:
    return sorted(
        p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
    )


def _options(group: str) -> list[str]:
    """Option names of a group, nested folders included (`a/b.yaml` -> `a/b`)."""
    root = CONFIG_DIR / group
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


def _default_groups() -> set[str]:
    """Groups named in train.yaml's defaults list (those take `group=x`, others `+group=x`)."""
    defaults = yaml.safe_load((CONFIG_DIR / "train.yaml").read_text()).get("defaults", [])
    names = set()
    for entry in defaults:
        if isinstance(entry, dict):
            for key in entry:
                names.add(key.removeprefix("override ").removeprefix("optional ").strip("/ "))
    return names


def _select(group: str, name: str) -> str:
    prefix = "" if group in _default_groups() else "+"
    return f"{prefix}{group}={name}"


ALL_CONFIGS = [(g, n) for g in _groups() for n in _options(g)]


def _compose(overrides: list[str]) -> Config:
    cfg, _ = to_config(compose_config(overrides))
    return cfg


# --------------------------------------------------------------------------- builders


_BUILT: dict[int, tuple[DataSplits, nn.Module, Task]] = {}


@pytest.fixture(autouse=True)
def _fresh_parts() -> Iterator[None]:
    _BUILT.clear()
    yield
    _BUILT.clear()


def _parts(cfg: Config) -> tuple[DataSplits, nn.Module, Task]:
    """Data, model (seeded) and task from the real builders, once per test (an experiment's
    checks share one GPT-2-sized model)."""
    if id(cfg) not in _BUILT:
        torch.manual_seed(0)
        model, _ = build_model(cfg.model, DistInfo())
        data, _ = build_data(cfg.data)
        check_fits(model, data, cfg.model)
        task = build_task(cfg.task)
        attach_reference(task, model, None)  # task=dpo: as the trainer assembles it
        _BUILT[id(cfg)] = (data, model, task)
    return _BUILT[id(cfg)]


def _batch(data: DataSplits, n: int = 4, offset: int = 0) -> Any:
    collate = data.collate_fn or default_collate
    return collate([data.train[i] for i in range(offset, offset + min(n, len(data.train)))])


def check_model(cfg: Config) -> None:
    data, model, task = _parts(cfg)
    batch = _batch(data)
    loss = task.loss_sum(model, batch)
    assert loss.ndim == 0 and torch.isfinite(loss), loss
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())


def check_task(cfg: Config) -> None:
    data, model, task = _parts(cfg)
    batch = _batch(data)
    if isinstance(task, GRPORunTask):
        check_grpo_task(task, model, batch)
        return
    count = task.count_items(batch)
    assert count.dtype in (torch.int64, torch.int32) and int(count) > 0
    with torch.no_grad():
        per_item = task.loss_sum(model, batch) / count
    # An untrained model is close to uniform: per-item loss is of the order of log(classes).
    assert 0 < float(per_item) < 20, float(per_item)


def _completion_batch(prompts: Any, g: int) -> Any:
    """The completion micro-batch of made-up rollouts of a prompt batch: each prompt's g
    completions of 3 tokens, rewards 0..g-1 (advantages that differ)."""
    from engine.rl.advantages import group_advantages
    from engine.rl.rollouts import Group, completion_batches, weighted_rewards

    gen = torch.Generator().manual_seed(0)
    groups = []
    for k in range(prompts["input_ids"].shape[0]):
        prompt = prompts["input_ids"][k, : int(prompts["prompt_lengths"][k])]
        rewards = torch.arange(g, dtype=torch.float64)[:, None]
        tokens = torch.randint(2, 200, (g, 3), generator=gen)
        full = torch.full((g,), 3)
        groups.append(Group(prompt, tokens, full, torch.zeros(g, dtype=torch.bool), rewards))
    adv = group_advantages(weighted_rewards(groups, torch.ones(1)), "group").values
    return completion_batches(groups, adv, len(groups) * g)[0]


def check_grpo_task(task: GRPORunTask, model: nn.Module, prompts: Any) -> None:
    """task=grpo trains on completions made from prompts: its loss is finite, its items
    the completions' tokens (dapo), and it back-propagates."""
    batch = _completion_batch(prompts, task.num_generations)
    count = task.count_items(batch)
    assert int(count) == int((batch["shift_labels"] != -100).sum()) > 0
    loss, sums = task.loss_and_sums(model, batch)
    assert torch.isfinite(loss) and int(sums["items"]) == int(count)
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())


def check_rollout(cfg: Config) -> None:
    """The policy generates a group of completions with `rollout.engine` (what is drawn,
    task.max_new_tokens / temperature / top_p, is task=grpo's: check_grpo_task)."""
    from trainer.models.gpt import GPT
    from trainer.rollout.engines import generation_engine
    from trainer.rollout.sampling import Sampling, completion_seeds

    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=64, n_layer=1, n_head=2, n_embd=16)
    sampling = Sampling(8, (1,), temperature=1.0, top_p=0.9)
    engine = generation_engine(cfg.rollout.engine, model)
    out = engine.generate(model, torch.tensor([5, 6, 7]), completion_seeds(0, 0, 0, 3), sampling)
    assert out.tokens.shape[0] == 3 and int(out.lengths.max()) <= sampling.max_new_tokens


def check_reward(cfg: Config) -> None:
    """`reward=NAME`: its functions score completions (reward=none: refused, one paragraph)."""
    from trainer.rollout.rewards import rewards_of_config

    if not cfg.reward.funcs:
        with pytest.raises(ConfigError, match="at least one reward function"):
            rewards_of_config(cfg.reward.funcs, cfg.reward.weights)
        return
    rewards = rewards_of_config(cfg.reward.funcs, cfg.reward.weights)
    rows = [{"answer": "12"}, {"answer": "13"}]
    scores = rewards.score(["q", "q"], ["<think>x</think> 12", "no"], [[3, 4], [5]], rows)
    assert scores.shape == (2, len(rewards.names)) and torch.isfinite(scores).all()


def check_data(cfg: Config) -> None:
    data, _ = build_data(cfg.data)
    assert len(data.train) > 0, f"{data.description}: empty training split"
    assert len(data.val) > 0, f"{data.description}: empty validation split"
    batch = _batch(data)
    assert int(build_task(cfg.task).count_items(batch)) > 0
    if data.seq_len is not None and isinstance(batch, tuple):
        assert batch[0].shape[1] <= data.seq_len


def check_optim(cfg: Config) -> None:
    data, model, task = _parts(cfg)
    opt = build_optimizer(cfg.optim, model)
    assert type(opt).__name__ == cfg.optim["_target_"].rsplit(".", 1)[1]
    assert all(g["lr"] == pytest.approx(cfg.optim["lr"]) for g in opt.param_groups)
    before = [p.detach().clone() for p in model.parameters()]
    task.loss_sum(model, _batch(data)).backward()
    opt.step()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before)), "optimizer step was a no-op"


def check_scheduler(cfg: Config) -> None:
    _, model, _ = _parts(cfg)
    model.zero_grad(set_to_none=True)  # optimizer steps without gradients: no-ops
    opt = build_optimizer(cfg.optim, model)
    sched = build_scheduler(cfg.scheduler, opt, cfg.train.max_steps)
    peak = cfg.optim["lr"]
    lrs = []
    for _ in range(cfg.train.max_steps + 5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: a no-op that keeps LambdaLR's call-order check quiet
        sched.step()
    assert all(0 <= lr <= peak * (1 + 1e-9) for lr in lrs), lrs
    assert lrs[0] > 0, "the first update must not use a zero learning rate"
    warmup = cfg.scheduler.get("warmup_steps", 0)
    if warmup < cfg.train.max_steps:
        assert lrs[warmup] == pytest.approx(peak), "peak lr not reached after warmup"
    if warmup > 0:
        assert lrs[0] < peak, "warmup does not start below the peak"


def check_logger(cfg: Config) -> None:
    # Validation already ran in to_config; W&B itself is not started here.
    assert set(cfg.logger.names) <= {"wandb", "tensorboard", "mlflow"}, cfg.logger.names
    if "wandb" in cfg.logger.names:
        assert cfg.logger.project, "logger.project must name a W&B project"
    for name in cfg.logger.names:
        assert importlib.util.find_spec(name) is not None, f"logger={name} needs {name} installed"


def check_step(cfg: Config) -> None:
    step_fn = build_step(cfg.step)
    data, model, task = _parts(cfg)
    opt = build_optimizer(cfg.optim, model)
    ctx = StepContext(
        model=model,
        optimizer=opt,
        scheduler=build_scheduler(cfg.scheduler, opt, cfg.train.max_steps),
        task=task,
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        clip_grad_norm=cfg.train.clip_grad_norm,
        callbacks=build_callbacks(cfg.callbacks, cfg.train),
    )
    window = [_batch(data, 2), _batch(data, 3, offset=2)]
    before = [p.detach().clone() for p in model.parameters()]
    result = step_fn(ctx, window)
    assert isinstance(result, StepResult)
    assert int(result.global_count) == sum(int(task.count_items(b)) for b in window)
    assert torch.isfinite(result.loss_sum) and torch.isfinite(result.grad_norm)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert ctx.step == 1


def check_callbacks(cfg: Config) -> None:
    callbacks = build_callbacks(cfg.callbacks, cfg.train)
    assert isinstance(callbacks, CallbackList)
    assert set(callbacks.named) == set(cfg.callbacks)


def check_experiment(cfg: Config) -> None:
    """An experiment configures a whole run: build every component of it."""
    for check in (check_model, check_task, check_optim, check_scheduler, check_logger):
        check(cfg)
    check_step(cfg)
    check_callbacks(cfg)
    check_data(cfg)


def check_adapter(cfg: Config) -> None:
    """adapter=lora: peft's adapters on the model, the base frozen; adapter=none: all train."""
    _, model, _ = _parts(cfg)
    adapter = build_adapter(cfg, model, DistInfo(), shards=False)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if cfg.adapter.kind == "none":
        assert adapter is None and len(trainable) == len(list(model.parameters()))
        return
    assert adapter is not None and trainable, "no trainable parameter"
    assert all(".lora_" in n for n in trainable), trainable
    check_model(cfg)  # forward and backward through the adapters


def check_profile(cfg: Config) -> None:
    """The run's profiler, for a world of two ranks (rank 0: the one that merges)."""
    from engine.timing import PhaseClock
    from trainer.tracking.profiler import NoProfiler, TorchProfiler, build_profiler

    with tempfile.TemporaryDirectory() as tmp:
        info = DistInfo(0, 2, 0, CPU)
        profiler = build_profiler(cfg.profile, Path(tmp), info, PhaseClock(CPU))
        kind = TorchProfiler if cfg.profile.kind == "torch" else NoProfiler
        assert type(profiler) is kind
        assert profiler.begin(1) == 0.0 and not profiler.recording  # before the window


def check_moe(cfg: Config) -> None:
    """The balancing of a mixture-of-experts run, as the engine takes it."""
    from engine.moe.balance import BalanceCfg
    from engine.moe.strategies import STRATEGIES

    balance = BalanceCfg(
        cfg.moe.balance, cfg.moe.aux_coef, cfg.moe.z_coef, bias_rate=cfg.moe.bias_rate
    )
    assert balance.balance in STRATEGIES


def check_ft(cfg: Config) -> None:
    """ft=torchft: the replica groups' settings and the whole job's batch plan, as the run
    takes them (nothing connects); ft=none: off."""
    from trainer.run.ft import job_plan, replica_settings

    if not cfg.ft.enabled:
        assert cfg.ft.kind == "none"
        return
    settings = replica_settings(cfg.ft)
    assert settings.lighthouse and 0 <= settings.group < settings.groups
    train = dataclasses.replace(cfg.train, global_batch_size=12, micro_batch_size=2)
    assert job_plan(train, cfg.ft, 1).dp_size == cfg.ft.groups


BUILDERS: dict[str, Callable[[Config], None]] = {
    "model": check_model,
    "task": check_task,
    "data": check_data,
    "optim": check_optim,
    "scheduler": check_scheduler,
    "logger": check_logger,
    "step": check_step,
    "callbacks": check_callbacks,
    "experiment": check_experiment,
    "adapter": check_adapter,
    "profile": check_profile,
    "moe": check_moe,
    "ft": check_ft,
    "rollout": check_rollout,
    "reward": check_reward,
}
# Groups whose checks build a model: use the small one unless the group picks the model itself.
NEEDS_SMALL_MODEL = {"optim", "scheduler", "step", "callbacks", "logger", "task", "adapter"}
# Choices that only fit together (an image model needs image data), checked in company.
PAIRS = ["model=hf_encoder", "task=contrastive", "data=pairs"]  # an encoder on text pairs
# gpt_tiny on preference pairs rendered by the tests' tiny tokenizer (320 ids).
PREFERENCE = ["model.vocab_size=320", "model.block_size=128", "task=dpo", "data=preference"]
# gpt_tiny generating for prompts rendered by the tests' tiny tokenizer, one reward.
GRPO = ["model.vocab_size=320", "model.block_size=128", "data=prompts", "reward=[exact_answer]"]
COMPANIONS = {
    ("model", "cnn"): ["data=digits", "task=classification"],
    ("model", "hf_encoder"): PAIRS,
    ("data", "pairs"): PAIRS,
    ("task", "contrastive"): PAIRS,
    ("step", "cached"): PAIRS,
    ("data", "digits"): ["model=cnn", "task=classification"],
    ("data", "preference"): [SMALL_MODEL, *PREFERENCE],
    ("task", "dpo"): PREFERENCE,
    ("ft", "torchft"): ["ft.lighthouse=http://127.0.0.1:29510"],  # what a launch passes
    ("task", "grpo"): GRPO,
}


def test_configs_are_discovered() -> None:
    """Guards the discovery itself: an empty list would make the main test vacuous."""
    found = set(ALL_CONFIGS)
    for expected in [("model", "gpt_tiny"), ("optim", "adamw"), ("scheduler", "cosine")]:
        assert expected in found, f"{expected} not discovered under {CONFIG_DIR}"


def test_every_group_has_a_builder_check() -> None:
    """A new config group needs a check here, or its configs would only be composed."""
    missing = [g for g in _groups() if g not in BUILDERS]
    assert not missing, f"config groups without an instantiation check: {missing}"


@pytest.mark.parametrize(("group", "name"), ALL_CONFIGS, ids=[f"{g}={n}" for g, n in ALL_CONFIGS])
def test_config_composes_and_instantiates(group: str, name: str, tmp_path: Path) -> None:
    """`<group>=<name>` composes, passes validation, and builds with the real builders."""
    overrides = [_select(group, name), *COMPANIONS.get((group, name), [])]
    if group in NEEDS_SMALL_MODEL:
        overrides.insert(0, SMALL_MODEL)
    if group == "scheduler":
        overrides.append("train.max_steps=120")  # enough for any warmup shipped, still fast
    cfg = _compose(overrides)
    if cfg.data.get("_target_") == "trainer.data.hf.hf_data":  # the user's dataset file
        docs = tmp_path / "docs.jsonl"
        docs.write_text("".join(f'{{"text": "document number {i}"}}\n' for i in range(200)))
        overrides.append(f"data.path={docs}")
    elif cfg.data.get("_target_") == "trainer.data.pairs.pairs_data":  # text pairs
        from tests.cached_support import write_pairs, write_tokenizer

        overrides.append(f"data.path={write_pairs(tmp_path / 'pairs.jsonl', 40)}")
        overrides.append(f"data.tokenizer={write_tokenizer(tmp_path / 'tokenizer')}")
    elif cfg.data.get("_target_") == "trainer.data.chat.chat_data":  # conversations + tokenizer
        from tests.chat_support import conversations, make_tokenizer, write_jsonl

        make_tokenizer(tmp_path / "tok")
        chat = write_jsonl(tmp_path / "chat.jsonl", conversations(40, max_turns=1))
        overrides += [f"data.path={chat}", f"data.tokenizer={tmp_path / 'tok'}"]
    elif cfg.data.get("_target_") == "trainer.data.preference.preference_data":  # pairs
        from tests.chat_support import make_tokenizer, write_jsonl
        from tests.preference_support import pair_rows

        make_tokenizer(tmp_path / "tok")
        pairs = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(40, seed=0))
        overrides += [f"data.path={pairs}", f"data.tokenizer={tmp_path / 'tok'}"]
    elif cfg.data.get("_target_") == "trainer.data.prompts.prompts_data":  # prompts + answers
        from tests.chat_support import make_tokenizer, write_jsonl
        from tests.prompts_support import prompt_rows

        make_tokenizer(tmp_path / "tok")
        prompts = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(40))
        overrides += [f"data.path={prompts}", f"data.tokenizer={tmp_path / 'tok'}"]
        overrides.append("data.max_new_tokens=16")
    elif cfg.data.get("path") == "required":  # a preset on a token .bin dataset the user provides
        for split, n in (("train", 20000), ("val", 3000)):  # > block_size + 1 tokens each
            np.arange(n, dtype="<u2").tofile(tmp_path / f"{split}.bin")
        overrides.append(f"data.path={tmp_path}")
    if group == "experiment" and "block_size" in cfg.data:
        # The preset's own model, on short samples and one block: a GPT-2-sized step on 1024
        # tokens takes a minute on one CPU thread; 16 tokens through one of its 12 blocks
        # show the same wiring in a second.
        overrides += ["data.block_size=16", "model.n_layer=1"]
    cfg = _compose(overrides)
    if group not in BUILDERS:
        pytest.fail(f"no instantiation check for config group {group!r}")
    BUILDERS[group](cfg)


def test_experiment_without_token_data_names_data_path() -> None:
    """The GPT-2 preset cannot fall back to byte data silently: data.path is required."""
    with pytest.raises(ConfigError, match=r"data\.path.*train\.bin"):
        build_data(_compose(["experiment=gpt2_small"]).data)


# --------------------------------------------------------------------------- the contract

CONTRACT_KEYS = [
    "seed",
    "train.max_steps",
    "train.micro_batch_size",
    "train.grad_accum_steps",
    "train.global_batch_size",
    "train.clip_grad_norm",
    "train.precision",
    "train.log_every",
    "train.compile",
    "optim.lr",
    "scheduler.warmup_steps",
    "model.dropout",
    "model.activation_checkpointing",
    "data.packed",
    "data.tokenize_workers",
    "data.cache_dir",
    "eval.every_steps",
    "checkpoint.every_steps",
    "checkpoint.keep_last",
    "checkpoint.resume",
    "dist.backend",
    "dist.strategy",
    "step",
    "callbacks",
    "adapter",
    "adapter.r",
    "adapter.alpha",
    "adapter.dropout",
    "adapter.target_modules",
    "adapter.modules_to_save",
    "adapter.use_dora",
    "profile.steps",
    "profile.ranks",
]


def test_contract_keys_exist_in_default_config() -> None:
    """Every key CONTRACT.md promises is in the composed default config and the schema."""
    raw = compose_config([])
    validated = _compose([])
    for key in CONTRACT_KEYS:
        node, obj = raw, validated
        for part in key.split("."):
            assert part in node, f"contract key {key!r} missing from the composed config"
            node = node[part]
            obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)


def test_contract_defaults() -> None:
    """Defaults the contract names: W&B logger, accumulate step, ddp, resume=auto."""
    cfg = _compose([])
    assert cfg.logger.names == ("wandb",)
    assert cfg.step["_target_"] == "engine.steps.accumulate.AccumulateStep"
    assert cfg.dist.strategy == "ddp"
    assert cfg.dist.backend is None  # chosen by device: nccl with CUDA, gloo otherwise
    assert cfg.checkpoint.resume == "auto"
    assert cfg.train.precision == "fp32"
    assert cfg.callbacks == {}
    assert cfg.adapter.kind == "none"  # adapter=none: every weight trains


CONTRACT_VALUES = [
    "train.precision=fp32",
    "train.precision=bf16",
    "train.precision=fp16",
    "train.clip_grad_norm=null",
    "train.global_batch_size=64",
    "train.compile=true",
    "model.activation_checkpointing=true",
    "model.dropout=0.1",
    "data.packed=false",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "checkpoint.resume=never",
    "checkpoint.resume=/some/run/checkpoints/step_00000010",
    "dist.backend=gloo",
    "dist.backend=nccl",
    "dist.strategy=ddp",
    "dist.strategy=fsdp",
    "logger=none",
    "logger=wandb",
    "logger=[wandb,tensorboard,mlflow]",
    "logger=tensorboard",
    "logger=mlflow",
    "model=gpt_tiny",
    "step=accumulate",
    "step=sam",
    "adapter=none",
    "adapter=lora",
]


@pytest.mark.parametrize("override", CONTRACT_VALUES)
def test_contract_values_validate(override: str) -> None:
    """Each value CONTRACT.md documents as valid composes and passes validation."""
    try:
        _compose([SMALL_MODEL, override])
    except UserError as exc:
        pytest.fail(f"{override} is documented as valid but rejected: {exc}")
    except Exception as exc:  # Hydra: unknown group option
        pytest.fail(f"{override} is documented as valid but does not compose: {exc}")


# --------------------------------------------------------------------------- optimizer groups


@pytest.mark.parametrize("bias", [True, False])
def test_no_weight_decay_on_biases_norms_embeddings(bias: bool) -> None:
    """Decay only the Linear weight matrices; identified by identity, not by name."""
    cfg = _compose([SMALL_MODEL, "optim=adamw", f"model.bias={str(bias).lower()}"])
    assert cfg.optim["weight_decay"] > 0, "the check needs a decaying optimizer config"
    _, model, _ = _parts(cfg)
    opt = build_optimizer(cfg.optim, model)

    no_decay: set[int] = set()
    matrices: set[int] = set()
    for module in model.modules():
        bias_param = getattr(module, "bias", None)
        if isinstance(bias_param, nn.Parameter):
            no_decay.add(id(bias_param))
        if isinstance(module, (nn.LayerNorm, nn.Embedding)):
            no_decay.update(id(p) for p in module.parameters(recurse=False))
        if isinstance(module, nn.Linear):
            matrices.add(id(module.weight))
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay_expected = matrices - embeddings  # the tied lm_head weight is the token embedding
    assert no_decay and decay_expected

    decay_of: dict[int, float] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            assert id(p) not in decay_of, "a parameter appears in two groups"
            decay_of[id(p)] = group["weight_decay"]
    all_params = {id(p) for p in model.parameters()}
    assert set(decay_of) == all_params, "param groups must cover every parameter exactly once"
    wrongly_decayed = [i for i in no_decay if decay_of[i] != 0.0]
    assert not wrongly_decayed, "biases / LayerNorm / embeddings must have weight_decay=0"
    for i in decay_expected:
        assert decay_of[i] == pytest.approx(cfg.optim["weight_decay"])
    # the tied output head shares the embedding and so is not decayed
    assert decay_of[id(model.lm_head.weight)] == 0.0
    assert model.lm_head.weight is model.tok_emb.weight


# --------------------------------------------------------------------------- schedules


def _lrs(overrides: list[str], n: int) -> list[float]:
    """The lr each of the first n optimizer updates uses, from the real builders."""
    cfg = _compose([SMALL_MODEL, *overrides])
    opt = build_optimizer(cfg.optim, _parts(cfg)[1])
    sched = build_scheduler(cfg.scheduler, opt, cfg.train.max_steps)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_cosine_values() -> None:
    """Warmup 4, decay to 0.1 x peak at step 12, peak 0.01: values worked out by hand.

    Update s (0-based) uses (s+1)/(W+1) during warmup, then
    min + (1-min) * (1 + cos(pi * (s-W)/(T-W))) / 2, and min from T on.
    """
    lrs = _lrs(
        [
            "scheduler=cosine",
            "scheduler.warmup_steps=4",
            "scheduler.min_lr_ratio=0.1",
            "train.max_steps=12",
            "optim.lr=0.01",
        ],
        16,
    )
    peak, lo = 0.01, 0.001
    expected = {
        0: peak * 1 / 5,
        1: peak * 2 / 5,
        3: peak * 4 / 5,
        4: peak,  # end of warmup: the peak
        6: lo + (peak - lo) * (1 + math.sqrt(0.5)) / 2,  # progress 1/4: cos = sqrt(2)/2
        8: lo + (peak - lo) / 2,  # halfway: cos(pi/2) = 0
        10: lo + (peak - lo) * (1 - math.sqrt(0.5)) / 2,  # progress 3/4
        12: lo,  # train.max_steps: the floor
        15: lo,  # past the end it stays there
    }
    for step, value in expected.items():
        assert lrs[step] == pytest.approx(value, rel=1e-9), f"lr at update {step}"
    decay = lrs[4:13]
    assert all(a >= b for a, b in itertools.pairwise(decay)), "cosine decay must not increase"


def test_warmup_constant_values() -> None:
    """Constant schedule: linear warmup over 3 updates, then exactly the peak forever."""
    lrs = _lrs(
        ["scheduler=constant", "scheduler.warmup_steps=3", "train.max_steps=8", "optim.lr=0.02"],
        10,
    )
    assert lrs == pytest.approx([0.005, 0.01, 0.015] + [0.02] * 7, rel=1e-9)


def test_warmup_linear_values() -> None:
    """Linear: warmup over 2 updates, then a straight line to min_lr_ratio at max_steps."""
    lrs = _lrs(
        ["scheduler=linear", "scheduler.warmup_steps=2", "scheduler.min_lr_ratio=0.0",
         "train.max_steps=10", "optim.lr=0.01"],
        12,
    )  # fmt: skip
    want = [0.01 / 3, 0.02 / 3] + [0.01 * (1 - (s - 2) / 8) for s in range(2, 10)] + [0.0, 0.0]
    assert lrs == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_warmup_stable_decay_values() -> None:
    """WSD: warmup over 2 updates, the peak until the last 4 of 10 steps, a linear decay to
    0.1 x peak at step 10, then the floor. Worked out by hand."""
    lrs = _lrs(
        ["scheduler=wsd", "scheduler.warmup_steps=2", "scheduler.decay_steps=4",
         "scheduler.min_lr_ratio=0.1", "train.max_steps=10", "optim.lr=0.01"],
        12,
    )  # fmt: skip
    peak, lo = 0.01, 0.001
    want = [peak / 3, 2 * peak / 3, peak, peak, peak, peak, peak]  # updates 0-6
    want += [lo + (peak - lo) * f for f in (0.75, 0.5, 0.25)] + [lo, lo]  # 7-9, then 10, 11
    assert lrs == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("shape", ["cosine", "sqrt"])
def test_wsd_decay_shapes_end_at_the_floor(shape: str) -> None:
    lrs = _lrs(
        ["scheduler=wsd", "scheduler.warmup_steps=0", "scheduler.decay_steps=5",
         f"scheduler.decay_shape={shape}", "scheduler.min_lr_ratio=0.2", "train.max_steps=10",
         "optim.lr=0.01"],
        11,
    )  # fmt: skip
    assert lrs[:6] == pytest.approx([0.01] * 6)  # stable until the decay starts at step 5
    assert all(a > b for a, b in itertools.pairwise(lrs[5:11]))
    assert lrs[10] == pytest.approx(0.002)


def test_wsd_decay_longer_than_the_run_names_the_key() -> None:
    cfg = _compose([SMALL_MODEL, "scheduler=wsd", "scheduler.decay_steps=20", "train.max_steps=10"])
    with pytest.raises(ConfigError, match=r"scheduler\.decay_steps"):
        build_scheduler(cfg.scheduler, build_optimizer(cfg.optim, _parts(cfg)[1]), 10)


def test_torch_scheduler_partial_is_accepted() -> None:
    """Any torch.optim.lr_scheduler class, with its own arguments, steps per optimizer step."""
    cfg = _compose(
        [SMALL_MODEL, "scheduler._target_=torch.optim.lr_scheduler.StepLR",
         "~scheduler.warmup_steps", "~scheduler.min_lr_ratio", "+scheduler.step_size=2",
         "+scheduler.gamma=0.5", "optim.lr=0.01"]
    )  # fmt: skip
    opt = build_optimizer(cfg.optim, _parts(cfg)[1])
    sched = build_scheduler(cfg.scheduler, opt, 10)
    lrs = []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.01, 0.01, 0.005, 0.005, 0.0025])


# --------------------------------------------------------------------------- components


@pytest.mark.parametrize(
    ("override", "key", "hint"),
    [
        ("model.n_layr=3", "model.n_layr", "n_layer"),  # a typo: the close match is offered
        ("model.n_layer=three", "model.n_layer", "an int"),
        ("model.dropout=[0.1]", "model.dropout", "a number"),
        ("optim.lr=fast", "optim.lr", "a number"),
        ("optim.betas=[0.9]", "optim.betas", "tuple"),
        ("model._target_=no.such.Model", "model._target_", "cannot import no.such.Model"),
        ("task._target_=engine.tasks.Nope", "task._target_", "no attribute 'Nope'"),
        ("data.num_workers=-1", "data.num_workers", ">= 0"),
        ("model.block_classes=Block", "model.block_classes", "list"),
    ],
)
def test_component_arguments_are_checked_before_anything_runs(
    override: str, key: str, hint: str
) -> None:
    """Component keys are checked against their target's signature (names, annotated types)
    when the config is validated: one line naming the key and what is valid."""
    with pytest.raises(ConfigError) as err:
        _compose([SMALL_MODEL, override])
    message = str(err.value)
    assert f"`{key}`" in message and hint in message, message
    assert "\n" not in message


def test_component_errors_from_the_constructor_name_the_argument() -> None:
    """A value the constructor rejects is reported under the argument's own key."""
    cfg = _compose([SMALL_MODEL, "model.n_head=3"])  # 32 is not divisible by 3
    with pytest.raises(ConfigError, match=r"`model\.n_embd`: n_embd must be divisible"):
        build_model(cfg.model, DistInfo())


def test_no_shipped_config_sets_hydra_mode() -> None:
    """`python -m trainer.train` lets the command line alone choose run or multirun
    (trainer.config.cli.compose_once): true only while no config shipped here sets
    `hydra.mode`, as none does today."""
    setters = []
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        node = yaml.safe_load(path.read_text()) or {}
        hydra_node = node.get("hydra") if isinstance(node, dict) else None
        if isinstance(hydra_node, dict) and "mode" in hydra_node:
            setters.append(str(path.relative_to(CONFIG_DIR)))
    assert not setters, f"these configs set hydra.mode; drop compose_once or them: {setters}"
