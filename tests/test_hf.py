"""Hugging Face transformers models keep every guarantee (`model=hf_gpt2`, `model=hf_llama`).

References are computed here with transformers itself: the step-1 gradient of the whole
global batch from HF's own per-token loss (`labels=`, its `ForCausalLMLoss`), which the
trainer never calls (it reads `.logits` and divides by the global count of targets).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import read_metrics, stdlib_text, train_in_process, train_records
from tests.ranks import explain, launch, launch_all, run_cli, torchrun_cmd

transformers = pytest.importorskip("transformers")

SEED = 1337
TIMEOUT = 240.0
GPT2 = {  # configs/model/hf_gpt2.yaml
    "vocab_size": 256,
    "n_positions": 128,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": None,
    "eos_token_id": None,
    "use_cache": False,
}
BLOCK = 32
COMMON = [
    "logger=none",
    "data.packed=false",  # one padded sample per paragraph: uneven valid-token counts
    f"data.block_size={BLOCK}",
    "train.max_steps=4",
    "train.log_every=1",
    "eval.every_steps=0",
    "scheduler.warmup_steps=2",
    "train.clip_grad_norm=null",  # DumpGrads reads the gradients after clipping
]
ONE = ["train.micro_batch_size=8", "train.grad_accum_steps=1"]
TWO = ["train.micro_batch_size=2", "train.grad_accum_steps=2"]  # x 2 ranks = 8
KILL = "tests.ckpt_support.KillOnce"


def train_cmd(args: list[str], run_dir: Path, nproc: int = 1) -> list[str]:
    launcher = torchrun_cmd(nproc) if nproc > 1 else [sys.executable]
    return [*launcher, "-m", "trainer.train", *args, f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """hf_gpt2 on padded text: 1 process, 2 ranks DDP, 2 ranks FSDP (sharded checkpoints),
    and the same FSDP run killed with -9 after step 3 and rerun."""
    root = tmp_path_factory.mktemp("hf_gpt2")
    text = stdlib_text(root / "text.py", 300_000)
    base = ["model=hf_gpt2", *COMMON, f"data.path={text}"]
    fsdp = [*base, *TWO, "dist.strategy=fsdp", "checkpoint.every_steps=2"]
    kill = [
        f"+callbacks.kill._target_={KILL}",
        "+callbacks.kill.step=3",
        f"+callbacks.kill.marker={root / 'kill.marker'}",
    ]
    dump = "+callbacks.dump._target_=tests.grad_dump.DumpGrads"
    g1, g2 = f"+callbacks.dump.path={root / 'g1.pt'}", f"+callbacks.dump.path={root / 'g2.pt'}"
    cmds = {
        "one": train_cmd([*base, *ONE, dump, g1], root / "one"),
        "ddp": train_cmd([*base, *TWO, "checkpoint.every_steps=4", dump, g2], root / "ddp", 2),
        "fsdp": train_cmd(fsdp, root / "fsdp", nproc=2),
        "killed": train_cmd([*fsdp, *kill], root / "killed", nproc=2),
    }
    first = launch_all(cmds, TIMEOUT)
    assert first["killed"].returncode != 0, "the kill did not happen"
    rerun = launch_all({"killed": cmds["killed"]}, TIMEOUT)["killed"]
    return {"root": root, "text": text, "procs": first, "rerun": rerun}


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in train_records(read_metrics(run_dir))}


def step1_batch(text: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1's global batch as the loader contract defines it (README: an epoch-wise
    permutation seeded by (seed, epoch), read global batch by global batch), padded here:
    inputs with 0, targets with -100."""
    from trainer.data.text import text_data

    train = text_data(path=str(text), packed=False, block_size=BLOCK).train
    order = np.random.default_rng([SEED, 0]).permutation(len(train))[:8]
    samples = [train[int(i)] for i in order]
    length = max(len(s) for s in samples) - 1
    x = torch.zeros(8, length, dtype=torch.int64)
    y = torch.full((8, length), -100, dtype=torch.int64)
    for row, s in enumerate(samples):
        x[row, : len(s) - 1] = s[:-1]
        y[row, : len(s) - 1] = s[1:]
    return x, y


def hf_gradients(x: torch.Tensor, y: torch.Tensor, micro: int | None = None) -> dict[str, Any]:
    """Gradients of HF's own loss for the batch (x, y) from the trainer's initial weights.
    `micro`: the textbook bug instead, the mean of per-micro-batch mean losses."""
    torch.manual_seed(SEED)  # what the trainer seeds before it builds the model
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    chunks = [(x, y)] if micro is None else list(zip(x.split(micro), y.split(micro)))
    for xs, ys in chunks:
        out = model(input_ids=xs, labels=ys, shift_labels=ys)  # targets are already shifted
        (out.loss / len(chunks)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.multiproc
def test_padded_batches_split_invariant_and_step1_gradient_is_hfs_full_batch(
    gpt2_runs: dict[str, Any],
) -> None:
    root, procs = gpt2_runs["root"], gpt2_runs["procs"]
    for name in ("one", "ddp"):
        assert procs[name].returncode == 0, explain(procs[name])
    one, two = losses(root / "one"), losses(root / "ddp")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step] - two[step]) <= 1e-5 * abs(one[step]), (step, one[step], two[step])

    x, y = step1_batch(gpt2_runs["text"])
    counts = [int((row != -100).sum()) for row in y]
    assert len(set(counts)) > 1, f"premise: uneven valid-token counts, got {counts}"
    want = hf_gradients(x, y)
    bug = hf_gradients(x, y, micro=2)
    worst_bug = 0.0
    for path in ("g1.pt", "g2.pt"):
        got = torch.load(root / path, weights_only=True)
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for name, g in got.items():
            torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-6, msg=name)
    for name, g in want.items():
        worst_bug = max(worst_bug, float((bug[name] - g).abs().max() / g.abs().max()))
    # The per-micro-batch mean would be off by far more than the tolerance above.
    assert worst_bug > 1e-2, worst_bug


@pytest.mark.multiproc
def test_fsdp_follows_ddp_ties_embeddings_and_resumes_bitwise(gpt2_runs: dict[str, Any]) -> None:
    root, procs = gpt2_runs["root"], gpt2_runs["procs"]
    assert procs["fsdp"].returncode == 0, explain(procs["fsdp"])
    ddp, fsdp = losses(root / "ddp"), losses(root / "fsdp")
    for step in ddp:
        assert abs(ddp[step] - fsdp[step]) <= 1e-5 * abs(ddp[step]), (step, ddp[step], fsdp[step])
    # GPT-2's output layer is its input embedding: one tensor, also in the full layout.
    full = torch.load(root / "ddp/checkpoints/step_00000004/state.pt", weights_only=True)
    assert torch.equal(full["model"]["lm_head.weight"], full["model"]["transformer.wte.weight"])

    rerun = gpt2_runs["rerun"]
    assert rerun.returncode == 0, explain(rerun)
    assert "resumed from" in rerun.stdout and "step_00000002" in rerun.stdout, explain(rerun)
    killed = [r for r in train_records(read_metrics(root / "killed"))]
    for r in killed:
        assert r["train/loss"] == fsdp[r["step"]], (r["step"], r["train/loss"], fsdp[r["step"]])
    assert max(r["step"] for r in killed) == 4


@pytest.mark.multiproc
def test_export_reloads_in_transformers_with_the_same_validation_loss(
    gpt2_runs: dict[str, Any], tmp_path: Path
) -> None:
    """scripts/export_hf.py on the FSDP run's sharded checkpoint: `from_pretrained` loads it,
    embeddings tied, and its loss on the validation set equals trainer.evaluate's."""
    root = gpt2_runs["root"]
    ckpt = root / "fsdp/checkpoints/step_00000004"
    out = tmp_path / "exported"
    export = launch([sys.executable, "scripts/export_hf.py", f"checkpoint={ckpt}", f"out={out}"])
    assert export.returncode == 0, explain(export)
    evaluated = run_cli(
        [f"checkpoint={ckpt}", f"data.path={gpt2_runs['text']}", "eval.max_batches=4"],
        module="trainer.evaluate",
    )
    assert evaluated.returncode == 0, explain(evaluated)
    want = json.loads(evaluated.stdout.strip().splitlines()[-1])

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    from trainer.data.text import text_data

    val = text_data(path=str(gpt2_runs["text"]), packed=False, block_size=BLOCK).val
    batch_size = 16  # eval.batch_size's default
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, 4 * batch_size, batch_size):
            for s in [val[i] for i in range(start, start + batch_size)]:
                out_ = model(input_ids=s[None, :-1], labels=s[None, 1:], shift_labels=s[None, 1:])
                total += float(out_.loss) * (len(s) - 1)
                count += len(s) - 1
    assert count == want["val/items"]
    assert abs(total / count - want["val/loss"]) <= 1e-5, (total / count, want["val/loss"])


@pytest.mark.launches
def test_hf_llama_learns_and_resumes_bitwise_after_kill(tmp_path: Path) -> None:
    text = stdlib_text(tmp_path / "text.py", 300_000)
    args = [
        "model=hf_llama",
        *[a for a in COMMON if not a.startswith("data.packed")],
        f"data.path={text}",
        *ONE,
        "train.max_steps=12",
        "checkpoint.every_steps=4",
        "optim.lr=3e-3",
    ]
    kill = [
        f"+callbacks.kill._target_={KILL}",
        "+callbacks.kill.step=7",
        f"+callbacks.kill.marker={tmp_path / 'kill.marker'}",
    ]
    first = launch_all(
        {
            "ref": train_cmd(args, tmp_path / "ref"),
            "killed": train_cmd([*args, *kill], tmp_path / "killed"),
        },
        TIMEOUT,
    )
    assert first["ref"].returncode == 0, explain(first["ref"])
    assert first["killed"].returncode != 0
    rerun = launch(train_cmd([*args, *kill], tmp_path / "killed"), TIMEOUT)
    assert rerun.returncode == 0, explain(rerun)
    ref = losses(tmp_path / "ref")
    for r in train_records(read_metrics(tmp_path / "killed")):
        assert r["train/loss"] == ref[r["step"]], (r["step"], r["train/loss"], ref[r["step"]])
    assert ref[12] < ref[1] - 1.0, ref  # from ~ln(256) = 5.5 down


@pytest.mark.launches
def test_missing_pretrained_directory_is_one_paragraph(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = run_cli(["model=hf_gpt2", f"model.pretrained={missing}", *COMMON])
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    (error,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert "model.pretrained" in error and str(missing) in error and "never" in error, error


def test_activation_checkpointing_keeps_the_trajectory_with_dropout(tmp_path: Path) -> None:
    """GPT2Block recomputed in backward (non-reentrant, RNG restored): the same dropout masks,
    so the same losses bit for bit; and bf16 autocast runs on the same model."""
    text = stdlib_text(tmp_path / "text.py", 100_000)
    args = [
        "model=hf_gpt2",
        *COMMON,
        f"data.path={text}",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=2",
        "train.max_steps=3",
        *[f"model.config.{k}=0.1" for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")],
    ]
    plain = train_in_process(args, tmp_path / "plain")
    recomputed = train_in_process([*args, "model.activation_checkpointing=true"], tmp_path / "ac")
    assert [r["train/loss"] for r in plain] == [r["train/loss"] for r in recomputed]
    bf16 = train_in_process([*args, "train.precision=bf16"], tmp_path / "bf16")
    assert all(abs(a["train/loss"] - b["train/loss"]) < 0.05 for a, b in zip(plain, bf16))


def test_hooks_generate_reproducibly_and_count_flops() -> None:
    """Samples come from transformers' generate, seeded by the generator passed in, with the
    global RNG untouched (training's dropout stream); MFU counts the config's shapes."""
    from trainer.models.hf import causal_lm

    model = causal_lm("gpt2", GPT2).eval()
    prompt = torch.randint(0, 256, (1, 8))
    before = torch.get_rng_state()
    outs = [model.generate(prompt, 6, generator=torch.Generator().manual_seed(3)) for _ in "ab"]
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (1, 14)
    # Position lookups cost nothing; the token embedding is also the output layer: it counts.
    body = sum(p.numel() for p in model.parameters()) - 128 * 64
    assert model.flops_per_token(32) == 6.0 * body + 12.0 * 2 * 64 * 32
    assert model.max_seq_len == 128 and model.vocab_size == 256


@pytest.mark.parametrize("kind", ["causal_lm", "encoder"])
def test_a_pretrained_model_is_built_in_training_mode(kind: str, tmp_path: Path) -> None:
    """`from_pretrained` returns a model in eval mode; trained so, its dropout was silently
    off (GPT-2's 0.1, BERT's 0.1). cumulus's builders return it in training mode, as a model
    built from its config is: two forwards of the same input differ by their dropout masks."""
    from tests.cached_support import TINY_BERT
    from trainer.models.encoder import encoder
    from trainer.models.hf import causal_lm

    dropout = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
    if kind == "causal_lm":
        transformers.GPT2LMHeadModel(
            transformers.GPT2Config(**{**GPT2, **dropout})
        ).save_pretrained(tmp_path)
        model = causal_lm(family="gpt2", pretrained=str(tmp_path))
        run = lambda ids: model(input_ids=ids).logits  # noqa: E731
    else:
        transformers.BertModel(transformers.BertConfig(**TINY_BERT)).save_pretrained(tmp_path)
        model = encoder(family="bert", pretrained=str(tmp_path))
        run = lambda ids: model(input_ids=ids, attention_mask=torch.ones_like(ids))  # noqa: E731
    assert model.training and all(m.training for m in model.modules())
    ids = torch.arange(16).view(2, 8) % 64
    with torch.no_grad():
        assert not torch.equal(run(ids), run(ids)), "dropout is off: the model is in eval mode"


def build_from(overrides: list[str]) -> torch.nn.Module:
    """The model the trainer builds from `overrides` (the config layer's rules included)."""
    from engine.distributed import DistInfo
    from tests.conftest import compose_config
    from trainer.config.cli import to_config
    from trainer.run.assemble import build_model

    cfg, _ = to_config(compose_config(overrides))
    return build_model(cfg.model, DistInfo())[0]


def test_a_pretrained_gpt2_keeps_its_runtime_fields(tmp_path: Path) -> None:
    """model=hf_gpt2 model.pretrained=DIR: DIR's dropout (0.1, GPT-2's) and use_cache (true)
    stand; the yaml's random-init 0.0 was applied over them before. A field the user names is
    applied, also one equal to the yaml's default (model.config.resid_pdrop=0.0), on the
    command line or in a config file of their own (hydra.searchpath)."""
    folder = tmp_path / "gpt2"
    dropout = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "use_cache": True}
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**GPT2, **dropout})).save_pretrained(
        folder
    )

    def rates(model: Any) -> dict[str, Any]:
        block = model.transformer.h[0]
        return {
            "embd": model.transformer.drop.p,
            "resid": block.attn.resid_dropout.p,
            "attn": block.attn.attn_dropout.p,
            "use_cache": model.config.use_cache,
        }

    own = build_from(["model=hf_gpt2", f"model.pretrained={folder}"])
    assert own.training
    assert rates(own) == {"embd": 0.1, "resid": 0.1, "attn": 0.1, "use_cache": True}
    named = build_from(
        ["model=hf_gpt2", f"model.pretrained={folder}", "model.config.resid_pdrop=0.0"]
    )
    assert rates(named) == {"embd": 0.1, "resid": 0.0, "attn": 0.1, "use_cache": True}
    mine = tmp_path / "configs"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "my_gpt2.yaml").write_text(
        "_target_: trainer.models.hf.causal_lm\nfamily: gpt2\n"
        f"pretrained: {folder}\nconfig:\n  attn_pdrop: 0.0\n  use_cache: false\n"
    )
    theirs = build_from(["model=my_gpt2", f"hydra.searchpath=[file://{mine}]"])
    assert rates(theirs) == {"embd": 0.1, "resid": 0.1, "attn": 0.0, "use_cache": False}
    # At random init the yaml's values are the model's.
    assert rates(build_from(["model=hf_gpt2"]))["resid"] == 0.0


def qwen3_moe_directory(folder: Path, experts: int = 4) -> Path:
    """A save_pretrained Qwen3-MoE of `experts` experts (the in-tree yaml's random init: 8).
    Built by cumulus's own class: one of transformers' MoE classes built first in a process
    would hand its cached experts implementation (grouped_mm, no float64 on a CPU) down to
    cumulus's subclass, which the float64 references of tests/test_moe.py then fail on."""
    from trainer.models.hf import causal_lm

    config = {
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 64,
    }
    causal_lm("qwen3_moe", config).save_pretrained(folder)
    return folder


def test_architecture_beside_a_pretrained_directory_is_refused(tmp_path: Path) -> None:
    """model.config.num_experts=8 beside a 4-expert directory was silently ignored: refused
    in one paragraph naming the key and the directory (and its value where config.json says
    one), given on the command line, in a config file of the user's, or to causal_lm from
    Python. The yaml's own num_experts: 8 is not the user's (the directory's 4 experts are
    built), and a runtime field applies."""
    from trainer.config.errors import ConfigError
    from trainer.models.hf import causal_lm

    folder = qwen3_moe_directory(tmp_path / "moe")
    base = ["model=hf_qwen3_moe", f"model.pretrained={folder}"]
    with pytest.raises(ConfigError) as info:
        build_from([*base, "model.config.num_experts=8"])
    text = str(info.value)
    assert info.value.key == "model.config.num_experts" and "\n" not in text, text
    with pytest.raises(ConfigError) as info:  # a field config.json holds: its value is said
        build_from([*base, "model.config.hidden_size=64"])
    assert "(hidden_size: 32 there)" in str(info.value), info.value
    assert f"model.pretrained={folder} decides it" in text, text
    mine = tmp_path / "configs"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "my_moe.yaml").write_text(
        "_target_: trainer.models.hf.causal_lm\nfamily: qwen3_moe\n"
        f"pretrained: {folder}\nconfig:\n  num_experts: 8\n"
    )
    with pytest.raises(ConfigError, match=r"model\.config\.num_experts"):
        build_from(["model=my_moe", f"hydra.searchpath=[file://{mine}]"])
    with pytest.raises(ConfigError, match=r"model\.config\.num_experts"):
        causal_lm("qwen3_moe", {"num_experts": 8}, pretrained=str(folder))
    model = build_from([*base, "model.config.router_aux_loss_coef=0.02"])
    assert model.config.num_experts == 4 and model.config.router_aux_loss_coef == 0.02
    assert [r.num_experts for r in model.routers()] == [4]


@pytest.mark.launches
def test_architecture_beside_a_pretrained_directory_exits_2(tmp_path: Path) -> None:
    folder = qwen3_moe_directory(tmp_path / "moe")
    args = ["model=hf_qwen3_moe", f"model.pretrained={folder}", "model.config.num_experts=8"]
    proc = run_cli([*args, *COMMON, f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    (error,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert "model.config.num_experts" in error and "architecture" in error, error
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_export_keeps_the_sources_use_cache(tmp_path: Path) -> None:
    """A Qwen3-MoE directory saved with use_cache true, trained a step and exported: the
    exported config.json says true, as the source did (the yaml's use_cache: false was applied
    and written before). Training builds no cache whatever the config says (its forwards pass
    use_cache=False: tests/test_chat.py packs rows through models whose config says true)."""
    import importlib.util

    from tests.conftest import REPO

    folder = qwen3_moe_directory(tmp_path / "moe")
    assert json.loads((folder / "config.json").read_text())["use_cache"] is True
    text = stdlib_text(tmp_path / "text.py", 20_000)
    args = ["model=hf_qwen3_moe", f"model.pretrained={folder}", *COMMON, f"data.path={text}"]
    args += [*ONE, "train.max_steps=1", "checkpoint.every_steps=1"]
    train_in_process(args, tmp_path / "run")
    spec = importlib.util.spec_from_file_location("export_hf", REPO / "scripts" / "export_hf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([f"checkpoint={tmp_path / 'run'}", f"out={tmp_path / 'out'}"])
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["use_cache"] is True, exported
    assert exported["num_local_experts"] == 4, exported
