"""`train.precision=fp8` (torchao float8 training of the Linear layers) and
`train.compile_mode` (torch.compile's mode, CUDA graphs among them): their CPU side (issue #61).

- fp8 on a CPU runs only under `train.fp8_emulate=true` (torchao's emulated casts): a tiny GPT
  trains, its blocks' Linear layers are torchao's `Float8Linear` and the output head is not,
  the losses stay near bf16's (a reference run here) without equalling them, and a run
  resumed from its step-2 checkpoint continues the uninterrupted run bit for bit.
- Without the switch a CPU is refused in one paragraph naming train.precision; so is a
  missing torchao (naming the extra), and dist.tp.
- Activation checkpointing leaves the run bit for bit the same.
- FSDP2 on 2 ranks trains as one process does, to certify's fp8 tolerance; 2 pipeline
  stages bit for bit.
- A converted GPT compiles (dynamo) as one graph with no break, its loss equal to eager fp8's.
- `train.compile_mode` reaches torch.compile: the compiled forward's inductor configuration
  holds the mode's options (CUDA graphs for reduce-overhead). Unknown modes, a mode without
  train.compile, and CUDA graphs over shapes that vary (a mixture of experts' among them) are
  refused.

fp8 tests skip without torchao (the extra `fp8`, which `make test` installs).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from engine.distributed import DistInfo
from engine.numerics.float8 import convert, plan
from engine.numerics.precision import Precision
from tests.conftest import (
    TINY,
    compile_and_record,
    compose_config,
    train_in_process,
    train_records,
)
from tests.ranks import explain, run_torchrun
from trainer.checks.certify import TOLERANCE
from trainer.config.cli import to_config
from trainer.config.errors import ConfigError
from trainer.config.schema import COMPILE_MODES
from trainer.run.assemble import assemble, build_task
from trainer.run.compatibility import Choices

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao (the extra fp8) not installed"
)
FP8 = ["train.precision=fp8", "train.fp8_emulate=true"]
STEPS = 4
# Measured here (gpt_tiny, micro 8 x accum 2, 6 steps): fp8 (emulated) is within 4.9e-4 of
# bf16's losses, bf16 within 6.2e-5 of fp32's. The bound leaves 4x.
FP8_VS_BF16 = 2e-3


def losses(records: list[dict[str, Any]]) -> list[float]:
    return [r["train/loss"] for r in train_records(records)]


def built(overrides: list[str]) -> Any:
    """The real assembly (model converted, compiled, laid out) of a one-process run."""
    cfg, _ = to_config(compose_config([*TINY, *overrides]))
    return assemble(cfg, DistInfo())


# ---- fp8


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An fp8 run with a checkpoint every 2 steps, and the same run in bf16."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao (the extra fp8) not installed")
    root = tmp_path_factory.mktemp("fp8")
    dirs = {"fp8": root / "fp8", "bf16": root / "bf16"}
    base = [*TINY, f"train.max_steps={STEPS}", "checkpoint.every_steps=2"]
    train_in_process([*base, *FP8, f"hydra.run.dir={dirs['fp8']}"], dirs["fp8"])
    bf16 = ["train.precision=bf16", f"hydra.run.dir={dirs['bf16']}"]
    train_in_process([*base, *bf16], dirs["bf16"])
    return dirs


@needs_torchao
def test_fp8_trains_near_bf16(runs: dict[str, Path]) -> None:
    from tests.conftest import read_metrics

    fp8, bf16 = losses(read_metrics(runs["fp8"])), losses(read_metrics(runs["bf16"]))
    assert len(fp8) == len(bf16) == STEPS
    diff = max(abs(a - b) for a, b in zip(fp8, bf16))
    assert diff <= FP8_VS_BF16, (fp8, bf16)
    assert diff > 0, "fp8 equals bf16 bit for bit: no layer computed in float8"
    assert fp8[-1] < fp8[0], fp8


@needs_torchao
def test_fp8_resumes_bit_for_bit(runs: dict[str, Path], tmp_path: Path) -> None:
    """From the fp8 run's step-2 checkpoint, in another run directory: steps 3 and 4 as the
    uninterrupted run's, to the bit."""
    from tests.conftest import read_metrics

    ckpt = runs["fp8"] / "checkpoints" / "step_00000002"
    assert ckpt.is_dir(), sorted((runs["fp8"] / "checkpoints").iterdir())
    args = [*TINY, f"train.max_steps={STEPS}", *FP8, f"checkpoint.resume={ckpt}"]
    resumed = train_records(train_in_process([*args, f"hydra.run.dir={tmp_path}"], tmp_path))
    whole = train_records(read_metrics(runs["fp8"]))
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("train/loss", "train/grad_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in whole[2:]], key


@needs_torchao
def test_fp8_with_activation_checkpointing_is_the_same_run(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Each block recomputed in backward (its float8 casts with it): bit for bit the run
    without activation checkpointing."""
    from tests.conftest import read_metrics

    args = [*TINY, f"train.max_steps={STEPS}", *FP8, "model.activation_checkpointing=true"]
    got = train_records(train_in_process([*args, f"hydra.run.dir={tmp_path}"], tmp_path))
    want = train_records(read_metrics(runs["fp8"]))
    for key in ("train/loss", "train/grad_norm"):
        assert [r[key] for r in got] == [r[key] for r in want], key


@needs_torchao
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("layout", "rtol"),
    [(["dist.strategy=fsdp", "train.micro_batch_size=4"], TOLERANCE["fp8"][1]), (["dist.pp=2"], 0)],
    ids=["fsdp2", "pp2"],
)
def test_fp8_on_two_ranks_trains_as_one_process(
    runs: dict[str, Path], layout: list[str], rtol: float, tmp_path: Path
) -> None:
    """The same global batch of 16 on 2 ranks. FSDP2 (micro 4 x accum 2 each) shards the
    float8 layers as any Linear (gathered in bf16, cast to float8 in their forward): losses
    and gradient norms follow the one-process fp8 run to certify's fp8 tolerance (measured:
    1.8e-4 relative in loss, 2.3e-3 in gradient norm; the bound is 1e-2). Pipeline stages
    (the same micro-batches of 8, so the same float8 scales) hold the converted blocks: bit
    for bit."""
    from tests.conftest import read_metrics

    args = [*TINY, f"train.max_steps={STEPS}", *FP8, *layout]
    proc = run_torchrun(2, [*args, f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, explain(proc)
    assert "precision fp8 (float8 Linear layers: 8 of 9" in proc.stdout
    got = train_records(read_metrics(tmp_path))
    want = train_records(read_metrics(runs["fp8"]))
    assert len(got) == len(want) == STEPS
    for key in ("train/loss", "train/grad_norm"):
        for a, b in zip(got, want):
            assert abs(a[key] - b[key]) <= rtol * abs(b[key]), (key, got, want)


@needs_torchao
def test_linear_layers_convert_and_the_head_stays() -> None:
    """gpt_tiny with a mixture in its second block: the first block's Linear layers are
    float8, the output head, the router and the shared expert (24 wide: not a multiple of 16)
    are plain Linear layers, and the banner line says which and why."""
    from torchao.float8.float8_linear import Float8Linear

    moe = ["+model.moe.experts=4", "+model.moe.every=2", "+model.moe.hidden=24"]
    parts = built([*FP8, *moe, "+model.moe.shared_experts=1"])
    model = parts.model
    dense, mixture = model.blocks[0], model.blocks[1].mlp
    for layer in (dense.attn.qkv, dense.attn.proj, dense.mlp.fc, dense.mlp.proj):
        assert isinstance(layer, Float8Linear), type(layer)
    for layer in (model.lm_head, mixture.router.gate, *mixture.shared[::2]):
        assert type(layer) is nn.Linear, type(layer)
    assert model.lm_head.weight is model.tok_emb.weight  # still tied
    kept = dict(parts.float8.kept)
    assert kept["lm_head"] == "output head"
    assert kept["blocks.1.mlp.router.gate"] == "router"
    assert kept["blocks.1.mlp.shared.0"] == "32 x 24: not multiples of 16"
    assert parts.precision("fp8") == (
        "fp8 (float8 Linear layers: 6 of 10; kept in bf16: blocks.1.mlp.router.gate (router), "
        "blocks.1.mlp.shared.0 (32 x 24: not multiples of 16), blocks.1.mlp.shared.2 (24 x 32: "
        "not multiples of 16), lm_head (output head); emulated: slow, for checking only)"
    )


@needs_torchao
def test_a_model_with_nothing_to_convert_is_refused() -> None:
    """24 wide: no Linear layer of gpt_tiny has sizes that are multiples of 16; fp8 would be
    bf16 under another name."""
    with pytest.raises(ConfigError) as info:
        built([*FP8, "model.n_embd=24"])
    message = str(info.value)
    assert message.startswith("invalid config `train.precision`: fp8 found no Linear layer of GPT")
    assert "blocks.0.attn.qkv: 24 x 72: not multiples of 16" in message
    assert "lm_head: output head" in message and message.endswith("fp32, bf16, fp16")


def test_plan_keeps_subclasses_and_odd_sizes() -> None:
    """Without torchao: what would be converted. A Linear subclass keeps its own forward."""

    class Own(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10), Own(16, 16), nn.Linear(16, 16))
    chosen, kept = plan(model, {model[3]: "output head"})
    assert list(chosen) == ["0"]
    assert kept == {
        "1": "64 x 10: not multiples of 16",
        "2": "a Own, not a plain Linear",
        "3": "output head",
    }


@needs_torchao
def test_converted_gpt_compiles_as_one_graph() -> None:
    """torch.compile over the converted GPT: dynamo traces torchao's float8 casts with the
    forward and the loss in one graph, no break, no recompile for the next micro-batch; the
    value is eager fp8's. (Recorded by a backend that runs dynamo's graph as traced: what
    inductor would compile, without its minute of compiling.)"""
    cfg, _ = to_config(compose_config([*TINY, *FP8, "model.n_layer=1"]))
    spec = {k: v for k, v in cfg.model.items() if k[0] != "_" and k != "activation_checkpointing"}
    from trainer.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(**spec)
    layers = convert(model, {model.lm_head: "output head"}, emulate=True)
    assert len(layers.converted) == 4
    task = build_task(cfg.task)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(256, (4, 64), generator=g) for _ in "xy") for _ in "ab"]
    precision = Precision("fp8", "cpu")
    assert precision.scaler is None and precision.dtype is torch.bfloat16  # as bf16
    with precision.autocast():
        want = [task.loss_sum(model, b).item() for b in batches]
    graphs, got, breaks, frames = compile_and_record(model, task, batches, precision)
    assert not breaks, f"graph breaks: {breaks}"
    assert len(graphs) == 1 and frames.get("ok") == 1, (len(graphs), frames)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def test_fp8_on_cpu_is_refused_without_emulation(tmp_path: Path) -> None:
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao (the extra fp8) not installed")
    with pytest.raises(ConfigError) as info:
        train_in_process([*TINY, "train.precision=fp8", f"hydra.run.dir={tmp_path}"], tmp_path)
    message = str(info.value)
    assert message.startswith("invalid config `train.precision`: fp8 trains Linear layers")
    assert "a cpu device has no float8 matmuls" in message
    assert "Valid here: fp32, bf16, fp16" in message and "train.fp8_emulate=true" in message
    assert "\n" not in message
    assert not (tmp_path / "checkpoints").exists()


def test_fp8_refusals_of_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing torchao names the extra; fp8_emulate without fp8, and fp8 with dist.tp, are
    refused."""
    for name in ("torchao", "torchao.float8"):  # as if not installed (import raises)
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"`train.precision`: fp8 needs torchao, which is not"):
        to_config(compose_config([*TINY, *FP8]))
    with pytest.raises(ConfigError, match=r"cumulus\[fp8\]"):
        to_config(compose_config([*TINY, "train.precision=fp8"]))
    with pytest.raises(ModuleNotFoundError, match=r"^train.precision=fp8 needs torchao.*\[fp8\]"):
        convert(nn.Sequential(nn.Linear(16, 16)), {}, emulate=True)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"`train.fp8_emulate`: emulates float8 matmuls for"):
        to_config(compose_config([*TINY, "train.precision=bf16", "train.fp8_emulate=true"]))
    tp = to_config(compose_config([*TINY, *FP8, "dist.tp=2"]))[0]
    with pytest.raises(ConfigError, match=r"fp8 is not available with dist.tp=2"):
        Choices.of(tp).checked()  # the compatibility table, from the config


# ---- train.compile_mode


def test_compile_modes_are_torch_compiles() -> None:
    from torch._inductor import list_mode_options

    assert set(COMPILE_MODES) == set(list_mode_options())


def inductor_options(model: nn.Module) -> dict[str, Any]:
    """The inductor configuration torch.compile gave `model`'s compiled forward (what dynamo
    hands inductor when the forward first runs)."""
    compiled = model._compiled_call_impl
    assert compiled is not None, "the model was not compiled"
    return inspect.getclosurevars(compiled).nonlocals["self"].compiler_config


@pytest.mark.parametrize("mode", ["null", "reduce-overhead", "max-autotune"])
def test_compile_mode_reaches_torch_compile(mode: str) -> None:
    parts = built(["train.compile=true", f"train.compile_mode={mode}"])
    options = inductor_options(parts.model)
    assert options["triton.cudagraphs"] is (mode != "null")
    assert options["max_autotune"] is (mode == "max-autotune")


CUDA_GRAPHS = ["train.compile=true", "train.compile_mode=reduce-overhead"]


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["train.compile=true", "train.compile_mode=fast"], r"`train.compile_mode`: must be nu"),
        (["train.compile_mode=reduce-overhead"], r"set train.compile=true to compile with"),
        ([*CUDA_GRAPHS, "data.packed=false"], r"`data.packed`: .*CUDA graphs.*lengths vary"),
        ([*CUDA_GRAPHS, "+data.sampling=poisson"], r"`data.sampling`: .*a different size"),
        (
            [*CUDA_GRAPHS, "+model.moe.experts=4", "+model.moe.top_k=2"],
            r"`model.moe.experts`: .*CUDA graphs.*a mixture of experts \(2 routers\)",
        ),
    ],
    ids=["unknown", "not-compiled", "padded", "poisson", "experts"],
)
def test_compile_mode_refusals(overrides: list[str], pattern: str, tmp_path: Path) -> None:
    """(A mixture of experts' dispatch gives each expert as many rows as were routed to it:
    it trained, a new graph per shape.)"""
    with pytest.raises(ConfigError, match=pattern):
        train_in_process([*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cuda_graphs_are_refused_for_a_transformers_mixture(tmp_path: Path) -> None:
    """hf_qwen3_moe (transformers' routers, hooked) under CUDA graphs: refused naming model."""
    pytest.importorskip("transformers")
    overrides = ["model=hf_qwen3_moe", *CUDA_GRAPHS, f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError) as err:
        train_in_process([*TINY, *overrides], tmp_path)
    message = str(err.value)
    assert message.startswith("invalid config `model`: train.compile_mode=reduce-overhead"), message
    assert "is a mixture of experts (2 routers)" in message and "\n" not in message, message


@needs_torchao
def test_bench_variants_compose(tmp_path: Path) -> None:
    """The GPU benchmark's fp8 and CUDA-graph rows (docs/benchmarks.md's pending command):
    their overrides compose over the gpt2_small preset and its shapes are static enough for
    reduce-overhead (packed data, a fixed micro-batch)."""
    from scripts import bench_nanogpt as bench

    extra = ["train.precision=fp8", "train.compile_mode=reduce-overhead"]
    cmd = bench.cumulus_gpu_cmd(50, tmp_path / "data", tmp_path / "run", extra)
    cfg, _ = to_config(compose_config(cmd[3:]))
    assert (cfg.train.precision, cfg.train.compile, cfg.train.compile_mode) == (
        "fp8",
        True,
        "reduce-overhead",
    )
    training = Choices.of(cfg, training=True)
    training.knowing(pads_batches=False).checked()  # packed tokens: not refused
    # data=chat (packed conversations too), data=preference: rows padded to the micro-batch's
    # longest by trainer.data's PadCollate (the assembly tells the table so)
    with pytest.raises(ConfigError, match=r"`data`: .*chat pads each micro-batch to its long"):
        training.knowing(pads_batches=True, data_description="chat").checked()


# ---- on a GPU (skipped here; docs/benchmarks.md's GPU session runs them)

CUDA = torch.cuda.is_available()
FLOAT8_GPU = CUDA and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
def test_cuda_graphs_train_as_the_default_mode(tmp_path: Path) -> None:
    """reduce-overhead replays the compiled step's CUDA graphs over 2 micro-batches a step:
    the same losses and gradient norms as torch.compile's default mode (the same kernels)."""
    base = [*TINY, f"train.max_steps={STEPS}", "train.precision=bf16", "train.compile=true"]
    runs = {}
    for mode in ("null", "reduce-overhead"):
        run_dir = tmp_path / mode
        args = [*base, f"train.compile_mode={mode}", f"hydra.run.dir={run_dir}"]
        runs[mode] = train_records(train_in_process(args, run_dir))
    for key in ("train/loss", "train/grad_norm"):
        got, want = [r[key] for r in runs["reduce-overhead"]], [r[key] for r in runs["null"]]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (key, got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not FLOAT8_GPU, reason="float8 matmuls need compute capability 8.9")
def test_fp8_on_a_float8_gpu_trains_near_bf16(tmp_path: Path) -> None:
    """Real float8 matmuls (no emulation): the losses stay near bf16's, as emulated ones do."""
    base = [*TINY, f"train.max_steps={STEPS}"]
    fp8 = train_records(
        train_in_process(
            [*base, "train.precision=fp8", f"hydra.run.dir={tmp_path / 'a'}"], tmp_path / "a"
        )
    )
    bf16 = train_records(
        train_in_process(
            [*base, "train.precision=bf16", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path / "b"
        )
    )
    diff = max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(fp8, bf16))
    assert 0 < diff <= FP8_VS_BF16, diff
