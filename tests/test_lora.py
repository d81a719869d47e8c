"""LoRA adapters through peft (`adapter=lora`): exact gradients, checkpoints of the adapters
alone that move between world sizes bit for bit, refusal of another base, the PEFT export and
the merge, evaluation, and the refusals of bad input.

The base is a tiny Llama saved here with `save_pretrained` (2 layers, hidden 32). References
are computed in this file: the float64 full-batch gradient of the step-1 loss with peft's own
layers on the base loaded by transformers, an uninterrupted run, and PEFT's own loading of
the exported directory.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import (
    read_metrics,
    received,
    stdlib_text,
    train_in_process,
    train_records,
)
from tests.ranks import explain, launch_all, python_cmd, torchrun

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEED = 1337
BLOCK = 32
LR = 1.0
TIMEOUT = 300.0
BASE = {  # a tiny Llama: what `model.pretrained` points at
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "use_cache": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "initializer_range": 0.2,  # gradients of lora_B far above the tolerance at step 1
}
ADAPTER = ["adapter=lora", "adapter.r=4", "adapter.alpha=8"]
COMMON = [
    "model=hf_llama",
    *ADAPTER,
    "logger=none",
    "data.packed=false",  # padded samples: uneven valid-token counts per micro-batch
    f"data.block_size={BLOCK}",
    "train.max_steps=4",
    "train.log_every=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=4",
    "optim=sgd",  # momentum 0.9: state to resume; step 1 is still -lr x the gradient
    f"optim.lr={LR}",
    "scheduler=constant",
    "train.clip_grad_norm=null",
]
ONE = ["train.micro_batch_size=4", "train.grad_accum_steps=2"]
TWO = ["train.micro_batch_size=4", "train.grad_accum_steps=1"]  # x 2 ranks = 8


def save_base(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).save_pretrained(path)
    return path


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process (micro 4 x accum 2), 2 ranks DDP (one step) and 2 ranks FSDP2 (micro 4
    each), each checkpointing every step; then each world resumes the other's step-2 checkpoint, the
    adapters are exported (PEFT directory, merged) and evaluated."""
    root = tmp_path_factory.mktemp("lora")
    base = save_base(root / "base", seed=1)
    text = stdlib_text(root / "text.py", 100_000)
    args = [*COMMON, f"model.pretrained={base}", f"data.path={text}"]
    fsdp = [*args, *TWO, "dist.strategy=fsdp", "train.memory_report=true"]
    first = launch_all(
        {
            "one": python_cmd("trainer.train", *args, *ONE, f"hydra.run.dir={root / 'one'}"),
            "ddp": torchrun(2, [*args, *TWO, "train.max_steps=1", f"hydra.run.dir={root / 'ddp'}"]),
            "fsdp": torchrun(2, [*fsdp, f"hydra.run.dir={root / 'fsdp'}"]),
        },
        TIMEOUT,
    )
    for name, proc in first.items():
        assert proc.returncode == 0, f"{name}: {explain(proc)}"
    # The runs are this session's own (signed with its secret): the README's commands, with
    # no flag. A copy of the one-process run as another user hands it over, its base moved:
    # naming the new base is enough for the export (data.pretrained follows it).
    theirs = received(ckpt(root / "one", 4), root / "theirs")
    moved = shutil.copytree(base, root / "moved_base")
    export = [sys.executable, "scripts/export_hf.py"]
    second = launch_all(
        {
            "one_from_fsdp": python_cmd(
                "trainer.train",
                *args,
                *ONE,
                f"checkpoint.resume={ckpt(root / 'fsdp', 2)}",
                f"hydra.run.dir={root / 'one_from_fsdp'}",
            ),
            "fsdp_from_one": torchrun(
                2,
                [
                    *fsdp,
                    f"checkpoint.resume={ckpt(root / 'one', 2)}",
                    f"hydra.run.dir={root / 'fsdp_from_one'}",
                ],
            ),
            "export": [*export, f"checkpoint={root / 'one'}", f"out={root / 'peft'}"],
            "merged": [
                *export,
                f"checkpoint={theirs}",
                f"model.pretrained={moved}",
                f"out={root / 'merged'}",
                "merge=true",
            ],
            "evaluate": python_cmd(
                "trainer.evaluate",
                f"checkpoint={root / 'fsdp'}",
                "eval.max_batches=2",
                "eval.batch_size=8",
            ),
        },
        TIMEOUT,
    )
    return {
        "root": root,
        "base": base,
        "text": text,
        "first": first,
        "second": second,
        "theirs": theirs,
        "moved": moved,
    }


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in train_records(read_metrics(run_dir))}


def trainable_state(path: Path) -> dict[str, torch.Tensor]:
    """The adapters a checkpoint holds, either layout, read here without the trainer: the
    full layout's `state.pt`, or DCP's shards into tensors shaped as the full layout's."""
    state = torch.load(path / "state.pt", weights_only=True)
    if "model" in state:
        return state["model"]
    import torch.distributed.checkpoint as dcp

    shapes = torch.load(ckpt(path.parents[2] / "one", 1) / "state.pt", weights_only=True)
    template = {"model": {k: torch.empty_like(v) for k, v in shapes["model"].items()}}
    dcp.load(template, checkpoint_id=str(path / "shards"), no_dist=True)
    return template["model"]


# --------------------------------------------------------------------------- the gradient


def step1_batch(text: Path) -> list[torch.Tensor]:
    """Step 1's global batch as the loader contract defines it (an epoch-wise permutation
    seeded by (seed, epoch), read global batch by global batch): 8 samples of uneven length."""
    from trainer.data.text import text_data

    train = text_data(path=str(text), packed=False, block_size=BLOCK).train
    order = np.random.default_rng([SEED, 0]).permutation(len(train))[:8]
    return [train[int(i)] for i in order]


def peft_model(base: Path, adapters: dict[str, torch.Tensor], dtype: torch.dtype) -> Any:
    """peft's LoRA (the run's settings) on the base as transformers loads it, holding
    `adapters` (names as cumulus's checkpoints give them)."""
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    wrapped = peft.get_peft_model(model, config)
    missing = set(adapters) - {n for n, _ in model.named_parameters()}
    assert not missing, sorted(missing)[:3]
    model.load_state_dict({k: v.to(dtype) for k, v in adapters.items()}, strict=False)
    return wrapped


def full_batch_gradient(base: Path, lora_a: dict[str, torch.Tensor], text: Path) -> dict:
    """d(loss)/d(lora_B) in float64 at lora_B = 0: the summed cross-entropy of every target of
    the global batch (each sample alone) over their count."""
    model = peft_model(base, lora_a, torch.float64)
    samples = step1_batch(text)
    count = sum(len(s) - 1 for s in samples)
    assert len({len(s) for s in samples}) > 1, "premise: uneven sample lengths"
    total = sum(
        torch.nn.functional.cross_entropy(
            model(input_ids=s[None, :-1]).logits[0], s[1:], reduction="sum"
        )
        for s in samples
    )
    (total / count).backward()
    return {n: p.grad for n, p in model.get_base_model().named_parameters() if "lora_B" in n}


@pytest.mark.multiproc
def test_lora_b_after_one_sgd_step_is_the_float64_full_batch_gradient(runs: dict) -> None:
    """lora_B starts at zero, so after one SGD step it is -lr x dL/dB (lora_A's gradient is
    zero at B = 0: A is still its initial value in the step-1 checkpoint)."""
    root = runs["root"]
    one = trainable_state(ckpt(root / "one", 1))
    lora_a = {k: v for k, v in one.items() if "lora_A" in k}
    want = full_batch_gradient(runs["base"], lora_a, runs["text"])
    assert len(want) == 14  # 7 linear layers x 2 blocks
    for name in ("one", "ddp", "fsdp"):
        got = trainable_state(ckpt(root / name, 1))
        assert set(got) == set(one), name  # adapters alone, whatever the layout
        for key, grad in want.items():
            expected = (-LR * grad).float()
            assert expected.abs().max() > 1e-3, "premise: updates 100x the tolerance"
            torch.testing.assert_close(got[key], expected, rtol=0, atol=1e-5, msg=f"{name} {key}")
    for name in ("one", "fsdp"):  # and the run learns
        assert losses(root / name)[4] < losses(root / name)[1]


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.multiproc
def test_checkpoints_hold_the_adapters_alone_and_move_between_world_sizes_bitwise(
    runs: dict,
) -> None:
    """1 process x accum 2 and 2 FSDP2 ranks x accum 1 compute every micro-batch alike and
    sum the two gradients once, so their trajectories agree bit for bit; a checkpoint of
    either resumes on the other and continues that trajectory bit for bit."""
    root, second = runs["root"], runs["second"]
    one, fsdp = losses(root / "one"), losses(root / "fsdp")
    assert sorted(one) == [1, 2, 3, 4] and one == fsdp, (one, fsdp)
    final = trainable_state(ckpt(root / "one", 4))
    for name, source in (("one_from_fsdp", "fsdp"), ("fsdp_from_one", "one")):
        proc = second[name]
        assert proc.returncode == 0, explain(proc)
        assert f"resumed from {ckpt(root / source, 2)}" in proc.stdout, explain(proc)
        resumed = losses(root / name)
        assert sorted(resumed) == [3, 4] and all(resumed[s] == one[s] for s in resumed), resumed
        got = trainable_state(ckpt(root / name, 4))
        assert all(torch.equal(got[k], final[k]) for k in final), name
    # Only the adapters and their optimizer state, and the base's fingerprint; the size said.
    state = torch.load(ckpt(root / "one", 4) / "state.pt", weights_only=True)
    assert all(".lora_" in k for k in state["model"]) and len(state["model"]) == 28
    assert set(state["optimizer"]["state"]) == set(state["model"])
    assert "model.embed_tokens.weight" in state["adapter"]["base"]
    summary = runs["first"]["one"].stdout
    size = re.search(
        r"newest checkpoint \S+step_00000004 \(([\d.]+) KB; the trainable param", summary
    )
    assert size and 10 < float(size.group(1)) < 1000, explain(runs["first"]["one"])


@pytest.mark.multiproc
def test_sharded_checkpoint_writes_the_optimizer_settings_once(runs: dict) -> None:
    """2 FSDP ranks: the settings of the optimizer's one group (lr, momentum...) are one value
    naming its 28 adapters, not a value per adapter and setting (280 of ~1.2 KB each); the
    shards stay within 5x the full layout's state.pt of the same adapters and optimizer (4.2x
    measured: DCP stores each tensor, each rank's shard of it, as its own ~1.2 KB torch.save)."""
    from engine.checkpoint.sharded import load_shards, read_metadata

    root = runs["root"]
    path = ckpt(root / "fsdp", 4) / "shards"
    keys = read_metadata(path).state_dict_metadata
    settings = [k for k in keys if k.startswith("optimizer.") and ".state." not in k]
    assert len(settings) == 1, (len(settings), settings[:3])
    group = {"optimizer": {settings[0].removeprefix("optimizer."): None}}
    load_shards(group, path)
    values, names = next(iter(group["optimizer"].values()))
    assert sorted(names) == sorted(trainable_state(ckpt(root / "one", 1))), names
    assert values["lr"] == LR and values["momentum"] == 0.9, values
    shards = sum(f.stat().st_size for f in path.iterdir())
    full = (ckpt(root / "one", 4) / "state.pt").stat().st_size
    assert shards < 5 * full, (shards, full)


@pytest.mark.multiproc
def test_memory_report_counts_optimizer_state_of_the_adapters_only(runs: dict) -> None:
    """FSDP2 on 2 ranks: each rank's momentum buffers are its shards of the adapters."""
    report = json.loads((runs["root"] / "fsdp" / "memory_report.json").read_text())
    adapters = sum(v.numel() for v in trainable_state(ckpt(runs["root"] / "one", 1)).values())
    total = sum(r["optimizer_bytes"] for r in report["ranks"])
    assert total == adapters * 4, (total, adapters)  # SGD momentum, fp32, sharded over ranks


@pytest.mark.multiproc
def test_resuming_onto_another_base_is_refused(runs: dict, tmp_path: Path) -> None:
    from trainer.config.errors import UserError

    other = save_base(tmp_path / "other", seed=2)
    args = [*COMMON, *ONE, f"model.pretrained={other}", f"data.path={runs['text']}"]
    source = ckpt(runs["root"] / "one", 2)
    with pytest.raises(UserError) as caught:
        train_in_process([*args, f"checkpoint.resume={source}"], tmp_path / "run")
    message = str(caught.value)
    assert "another base model" in message and str(other) in message, message
    assert "\n" not in message
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


# --------------------------------------------------------------------------- export


def logits_of(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def cumulus_model(path: Path) -> Any:
    """The checkpoint's model as cumulus builds it for evaluation: its config, the base from
    `model.pretrained`, the adapters loaded."""
    from omegaconf import OmegaConf

    from engine.checkpoint import load_checkpoint
    from engine.distributed import DistInfo
    from engine.parallel.dims import build_parallelism
    from engine.rng import seed_everything
    from trainer.run.assemble import build_model
    from trainer.run.evaluation import checkpoint_config
    from trainer.run.extensions.adapter import build_adapter
    from trainer.run.state import RunState

    cfg = OmegaConf.to_object(checkpoint_config(path, []))  # its own run: no flag
    info = DistInfo()
    seed_everything(cfg.seed)  # a random-init base is its seed's
    model, _ = build_model(cfg.model, info)
    adapter = build_adapter(cfg, model, info, shards=False)
    RunState(model, None, build_parallelism("ddp", info), adapter=adapter).load(
        load_checkpoint(path, info)
    )
    return model.eval()


@pytest.mark.multiproc
def test_peft_loads_the_export_and_the_merged_model_gives_the_same_logits(runs: dict) -> None:
    root, second = runs["root"], runs["second"]
    for name in ("export", "merged"):
        assert second[name].returncode == 0, explain(second[name])
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["base_model_name_or_path"] == str(runs["base"])
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    from safetensors.torch import load_file

    keys = load_file(root / "peft" / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") for k in keys), list(keys)[:3]
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = logits_of(cumulus_model(ckpt(root / "one", 4)), ids)
    base = transformers.AutoModelForCausalLM.from_pretrained(runs["base"])
    plain = logits_of(base, ids)
    loaded = peft.PeftModel.from_pretrained(base, root / "peft").eval()
    theirs = logits_of(loaded, ids)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3, "premise: the adapters change the logits"
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # The console names the class config.json names (not cumulus's own subclass of it).
    (arch,) = json.loads((root / "merged" / "config.json").read_text())["architectures"]
    assert arch == type(merged).__name__ == "LlamaForCausalLM"
    assert f"as the merged model ({arch})," in second["merged"].stdout, second["merged"].stdout
    torch.testing.assert_close(logits_of(merged, ids), theirs, rtol=0, atol=1e-4)


@pytest.mark.multiproc
def test_a_moved_base_is_named_again_and_what_it_gave_follows(runs: dict) -> None:
    """A received checkpoint (signed elsewhere: its paths are data) whose base was moved:
    `model.pretrained=NEW_DIR` is enough for the export, and with the data named again for
    the evaluation. `data.pretrained`, which the run derived from `model.pretrained`, follows
    the new directory; a key the user set (`data.block_size`) keeps its value. The saved base
    is still refused when not named. (The fixture's merged export is this checkpoint's.)"""
    from scripts.export_hf import USES
    from trainer.config.trust import BUILT_FROM_SAVED, UntrustedConfigError
    from trainer.run.evaluation import checkpoint_config

    theirs, moved = runs["theirs"], runs["moved"]
    assert runs["second"]["merged"].returncode == 0, explain(runs["second"]["merged"])
    for uses, extra in ((USES, []), (BUILT_FROM_SAVED, [f"data.path={runs['text']}"])):
        cfg = checkpoint_config(theirs, [f"model.pretrained={moved}", *extra], uses=uses)
        assert cfg.model.pretrained == str(moved) and cfg.data.pretrained == str(moved)
        assert cfg.data.block_size == BLOCK
    with pytest.raises(UntrustedConfigError, match=f"`model.pretrained: '{runs['base']}'`"):
        checkpoint_config(theirs, [], uses=USES)


@pytest.mark.multiproc
def test_evaluate_takes_the_base_from_the_runs_pretrained_directory(runs: dict) -> None:
    """trainer.evaluate on the FSDP run's sharded adapter checkpoint, in one process, with no
    flag (the run is this user's own: its paths are theirs), the base taken from the run's
    `model.pretrained`: its validation loss is PEFT's on the same samples."""
    proc = runs["second"]["evaluate"]
    assert proc.returncode == 0, explain(proc)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    from trainer.data.text import text_data

    adapters = trainable_state(ckpt(runs["root"] / "fsdp", 4))
    model = peft_model(runs["base"], adapters, torch.float64).eval()
    val = text_data(path=str(runs["text"]), packed=False, block_size=BLOCK).val
    total, count = 0.0, 0
    with torch.no_grad():
        for s in (val[i] for i in range(16)):  # 2 batches of 8
            logits = model(input_ids=s[None, :-1]).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits, s[1:], reduction="sum"))
            count += len(s) - 1
    assert got["step"] == 4 and got["val/items"] == count, got
    assert abs(got["val/loss"] - total / count) <= 1e-5, (got, total / count)


# --------------------------------------------------------------------------- in process

SMALL = [
    "model=gpt_tiny",
    "logger=none",
    "train.max_steps=2",
    "train.log_every=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=2",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
]


@pytest.fixture
def small_text(tmp_path: Path) -> Path:
    return stdlib_text(tmp_path / "text.py", 20_000)


def lora_cfg(**changes: Any) -> Any:
    from trainer.config.schema import AdapterCfg

    values = {"kind": "lora", "r": 4, "alpha": 8.0, "dropout": 0.0}
    values |= {"target_modules": "all-linear", "use_dora": False, **changes}
    return AdapterCfg(**values)


def test_target_modules_that_name_nothing_list_the_models_linear_modules(
    small_text: Path, tmp_path: Path
) -> None:
    from trainer.config.errors import ConfigError

    args = [*SMALL, f"data.path={small_text}", "adapter=lora", "adapter.target_modules=[q_proj]"]
    with pytest.raises(ConfigError) as caught:
        train_in_process(args, tmp_path / "run")
    message = str(caught.value)
    assert "adapter.target_modules" in message and "'q_proj' names no module" in message
    assert "fc (x2), lm_head, proj (x4), qkv (x2)" in message, message
    assert "the output layer is lm_head" in message and "\n" not in message


def test_a_layer_peft_cannot_wrap_is_one_paragraph(small_text: Path, tmp_path: Path) -> None:
    from trainer.config.errors import UserError

    args = [*SMALL, f"data.path={small_text}", "adapter=lora", "adapter.target_modules=[ln_f]"]
    with pytest.raises(UserError) as caught:
        train_in_process(args, tmp_path / "run")
    message = str(caught.value)
    assert message.startswith("adapter=lora: peft cannot wrap GPT"), message
    assert "is not supported" in message and "qkv" in message and "\n" not in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_lora_keys_without_adapter_lora_and_bad_values_are_refused() -> None:
    from tests.conftest import compose_config
    from trainer.config.cli import to_config
    from trainer.config.errors import ConfigError

    for overrides, key in (
        (["adapter.r=8"], "adapter.r"),
        (["adapter=lora", "adapter.r=0"], "adapter.r"),
        (["adapter=lora", "adapter.dropout=1.5"], "adapter.dropout"),
        (["adapter=lora", "adapter.target_modules=[]"], "adapter.target_modules"),
    ):
        with pytest.raises(ConfigError, match=rf"`{key}`"):
            to_config(compose_config(["model=gpt_tiny", *overrides]))


def test_tensor_and_pipeline_parallelism_are_refused_in_one_paragraph() -> None:
    """From the config alone (the compatibility table, trainer/run/compatibility.py)."""
    from tests.conftest import compose_config
    from trainer.config.cli import to_config
    from trainer.config.errors import ConfigError
    from trainer.run.lifecycle import check_choices

    for layout, key in (("dist.tp=2", "dist.tp"), ("dist.pp=2", "dist.pp")):
        cfg, _ = to_config(compose_config(["model=gpt_tiny", "adapter=lora", layout]))
        with pytest.raises(ConfigError) as caught:
            check_choices(cfg)
        message = str(caught.value)
        assert f"`{key}`" in message and "dist.strategy=fsdp" in message and "\n" not in message
    allowed = ["model=gpt_tiny", "adapter=lora", "dist.strategy=fsdp"]
    check_choices(to_config(compose_config(allowed))[0])


def test_missing_peft_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.config.errors import UserError
    from trainer.models.lora import require_peft

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(
        UserError, match=r"^adapter=lora: peft is not installed.*cumulus\[adapter\]"
    ):
        require_peft()


def test_fsdp_upcasts_mixed_trainable_dtypes_with_one_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A bf16 base: peft keeps its adapters in fp32 but the modules_to_save copy in bf16, two
    dtypes FSDP2 refuses in one unit; under dist.strategy=fsdp they become one."""
    from trainer.models.gpt import GPT
    from trainer.models.lora import apply_adapter

    def trainable_dtypes(shards: bool) -> set[torch.dtype]:
        model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=64).to(torch.bfloat16)
        apply_adapter(model, lora_cfg(modules_to_save=["ln_f"]), shards=shards)
        return {p.dtype for p in model.parameters() if p.requires_grad}

    assert trainable_dtypes(shards=False) == {torch.float32, torch.bfloat16}  # the premise
    capsys.readouterr()
    assert trainable_dtypes(shards=True) == {torch.float32}
    (note,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("NOTE")]
    assert "bfloat16, float32" in note and "2 of them were upcast to float32" in note, note


def test_dora_trains_its_magnitudes_too() -> None:
    from trainer.models.gpt import GPT
    from trainer.models.lora import apply_adapter

    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=64)
    apply_adapter(model, lora_cfg(use_dora=True, target_modules=["qkv"]))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sum("lora_magnitude_vector" in n for n in names) == 2 and len(names) == 6, names
    ids = torch.randint(0, 256, (2, 16))
    model(ids).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_activation_checkpointing_on_a_frozen_base_keeps_the_trajectory(
    small_text: Path, tmp_path: Path
) -> None:
    """The in-tree GPT by its module names (all-linear: every linear but the output layer),
    adapter dropout on: recomputed blocks give the same losses and adapters bit for bit."""
    args = [*SMALL, f"data.path={small_text}", "adapter=lora", "adapter.dropout=0.1"]
    plain = train_in_process(args, tmp_path / "plain")
    ac = train_in_process([*args, "model.activation_checkpointing=true"], tmp_path / "ac")
    assert [r["train/loss"] for r in train_records(plain)] == [
        r["train/loss"] for r in train_records(ac)
    ]
    a, b = (trainable_state(ckpt(tmp_path / n, 2)) for n in ("plain", "ac"))
    assert sorted(a) == sorted(b) and len(a) == 16  # qkv, proj, fc, proj x 2 blocks x A, B
    assert not any(k.startswith("lm_head") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(b[k].abs().max() > 0 for k in b if "lora_B" in k), "the adapters learned"


def test_in_tree_gpt_exports_merged_as_gpt2(small_text: Path, tmp_path: Path) -> None:
    """merge=true: the GPT with its adapters merged, as GPT2LMHeadModel, same logits; its
    PEFT directory is refused (no transformers base to name)."""
    from omegaconf import OmegaConf

    from engine.distributed import DistInfo
    from scripts.export_hf import export
    from trainer.config.errors import UserError
    from trainer.run.evaluation import checkpoint_config

    train_in_process([*SMALL, f"data.path={small_text}", "adapter=lora"], tmp_path / "run")
    path = ckpt(tmp_path / "run", 2)
    cfg = OmegaConf.to_object(checkpoint_config(path, [f"data.path={small_text}"]))
    export(path, cfg, DistInfo(), tmp_path / "merged", merge=True)
    with pytest.raises(UserError, match="export merged only"):
        export(path, cfg, DistInfo(), tmp_path / "peft", merge=False)
    merged = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits_of(merged, ids), cumulus_model(path)(ids), rtol=0, atol=1e-4)


def test_plan_counts_optimizer_state_for_the_adapters_alone(
    small_text: Path, tmp_path: Path
) -> None:
    """trainer.plan on 2 simulated FSDP2 ranks: AdamW's two moments (and a step count per
    tensor) of this rank's shards of the adapters, nothing for the frozen base."""
    from trainer.plan import main

    out = tmp_path / "plan.json"
    main([*SMALL, f"data.path={small_text}", *ADAPTER, "dist.strategy=fsdp", "plan.world=2",
          f"plan.out={out}"])  # fmt: skip
    (role,) = json.loads(out.read_text())["roles"]
    from trainer.models.gpt import GPT
    from trainer.models.lora import apply_adapter

    model = GPT(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)
    apply_adapter(model, lora_cfg())
    adapters = [p for p in model.parameters() if p.requires_grad]
    per_rank = sum(p.numel() for p in adapters) // 2
    assert role["optimizer_bytes"] == 2 * 4 * per_rank + 4 * len(adapters)
    assert role["gradients_bytes"] == 4 * per_rank
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen > 2 * per_rank  # the premise: counting the base would show


def test_flops_leave_out_the_frozen_base_weight_gradients(small_text: Path) -> None:
    """MFU's FLOPs per token for an adapter run: a frozen weight costs its forward and input
    gradient (4 per parameter), not the weight gradient (2 more) a trained one costs."""
    from omegaconf import OmegaConf

    from engine.distributed import DistInfo
    from tests.conftest import compose_config
    from trainer.run.assemble import assemble

    def parts(*extra: str) -> Any:
        cfg = OmegaConf.to_object(compose_config([*SMALL, f"data.path={small_text}", *extra]))
        return assemble(cfg, DistInfo())

    full, lora = parts(), parts("adapter=lora")
    frozen = sum(p.numel() for p in lora.model.parameters() if not p.requires_grad)
    added = sum(p.numel() for p in lora.model.parameters() if p.requires_grad)
    assert frozen == sum(p.numel() for p in full.model.parameters())
    assert lora.flops_per_token == pytest.approx(full.flops_per_token + 6 * added - 2 * frozen)
