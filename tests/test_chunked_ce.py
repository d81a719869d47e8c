"""The chunked cross-entropy (engine/numerics/chunked_ce.py) is the plain loss, without its logits.

References are computed here with `F.cross_entropy(F.linear(...), reduction="sum")` over the
full logits, and the trainer's chunked runs are compared with its plain (`task.chunk_size=
null`) runs of the same config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.numerics.chunked_ce import (
    HOST_CHUNK_SIZE,
    ChunkedCrossEntropy,
    OutputHead,
    PlainCrossEntropy,
    auto_chunk_size,
    chunk_size_for,
    chunked_cross_entropy,
)
from engine.numerics.precision import Precision
from engine.tasks import CausalLMTask
from tests.conftest import (
    compile_and_record,
    compose_config,
    read_metrics,
    stdlib_text,
    train_in_process,
    train_records,
)
from tests.ranks import explain, launch_all, torchrun_cmd
from trainer.config.cli import to_config
from trainer.models.gpt import GPT, FakeQuantLinear
from trainer.run.assemble import build_task

N, C, V = 301, 24, 1000  # tokens, width, vocabulary


def problem(dtype: torch.dtype, bias: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Hidden states (N, C), weight (V, C), bias (V,) or None, targets (N,) with ignored
    positions (every 7th, and a run at the end as padding would be)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, C, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(V, (N,), generator=g)
    targets[::7] = -100
    targets[-20:] = -100
    return hidden, weight, b, targets


def grads_of(loss: torch.Tensor, tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    # An upstream factor other than 1, as the step's 1 / global_count is.
    present = [t for t in tensors if t is not None]
    return list(torch.autograd.grad(loss * 0.37, present))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 64, 97, N, 4096])  # 97 does not divide 301
def test_value_and_gradients_equal_the_plain_loss(
    dtype: torch.dtype, bias: bool, chunk: int
) -> None:
    hidden, weight, b, targets = problem(dtype, bias)
    want = F.cross_entropy(F.linear(hidden, weight, b), targets, reduction="sum")
    want_grads = grads_of(want, [hidden, weight, b])
    got = chunked_cross_entropy(hidden, weight, targets, bias=b, chunk_size=chunk)
    got_grads = grads_of(got, [hidden, weight, b])
    assert got.dtype == dtype
    rel = 1e-6 if dtype == torch.float32 else 1e-12
    assert abs(got.item() - want.item()) <= rel * abs(want.item()), (got.item(), want.item())
    # Gradients: round-off of the dtype, relative to each gradient's largest entry.
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        assert g.dtype == w.dtype and g.shape == w.shape
        err = (g - w).abs().max().item() / w.abs().max().item()
        assert err <= tol, (name, err)


def test_all_ignored_gives_zero_loss_and_gradients_like_the_plain_loss() -> None:
    hidden, weight, _, targets = problem(torch.float32, bias=False)
    targets = torch.full_like(targets, -100)
    got = chunked_cross_entropy(hidden, weight, targets, chunk_size=64)
    want = F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum")
    assert got.item() == want.item() == 0.0
    for g in grads_of(got, [hidden, weight]):
        assert not g.any()


class Shapes(TorchDispatchMode):
    """Records every tensor any aten op creates (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), tuple(t.shape), t.dtype))
        return out

    def largest(self) -> int:
        return max(torch.Size(shape).numel() for _, shape, _ in self.outputs)


def test_the_logits_of_all_tokens_never_exist() -> None:
    hidden, weight, b, targets = problem(torch.float32, bias=True)
    chunk = 64
    with Shapes() as plain:  # the detector sees the full logits where they exist
        loss = F.cross_entropy(F.linear(hidden, weight, b), targets, reduction="sum")
        loss.backward()
    assert plain.largest() >= N * V
    assert any(shape == (N, V) for _, shape, _ in plain.outputs)

    with Shapes() as chunked:
        loss = chunked_cross_entropy(hidden, weight, targets, bias=b, chunk_size=chunk)
        loss.backward()
    assert chunked.outputs, "the detector saw nothing"
    assert chunked.largest() <= chunk * V, max(chunked.outputs, key=lambda o: torch.Size(o[1]))
    assert any(shape == (chunk, V) for _, shape, _ in chunked.outputs)  # it did run chunked
    assert hidden.grad is not None and weight.grad is not None and b is not None


def test_autocast_multiplies_low_and_sums_fp32() -> None:
    """bf16 autocast: the chunk matmuls run in bf16 like the plain path's, the loss and the
    gradients come out fp32 and are as close to the fp32 loss's as the plain bf16 path's."""
    hidden, weight, _, targets = problem(torch.float32, bias=False)
    exact = F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum")
    exact_grads = grads_of(exact, [hidden, weight])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
        with Shapes() as seen:
            got = chunked_cross_entropy(hidden, weight, targets, chunk_size=64)
    plain_grads = grads_of(plain, [hidden, weight])
    got_grads = grads_of(got, [hidden, weight])
    assert got.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got_grads)
    chunk_logits = [d for f, s, d in seen.outputs if "addmm" in f or "mm" in f if s == (64, V)]
    assert chunk_logits and set(chunk_logits) == {torch.bfloat16}, seen.outputs[:10]
    assert abs(got.item() - exact.item()) <= 1e-2 * abs(exact.item())
    assert abs(got.item() - plain.item()) <= 1e-4 * abs(plain.item())
    for g, p, e in zip(got_grads, plain_grads, exact_grads):
        scale = e.abs().max().item()
        err_got = (g - e).abs().max().item() / scale
        err_plain = (p - e).abs().max().item() / scale
        assert err_got <= max(1.5 * err_plain, 1e-3), (err_got, err_plain)


def test_no_grad_computes_the_value_only() -> None:
    hidden, weight, _, targets = problem(torch.float32, bias=False)
    want = F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum")
    with torch.inference_mode(), Shapes() as seen:
        got = chunked_cross_entropy(hidden, weight, targets, chunk_size=64)
    assert not got.requires_grad
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    # No weight gradient is formed (a dtype no-op `.to` returns the weight itself).
    formed = {f for f, s, _ in seen.outputs if s == (V, C) and not f.startswith("aten.to.")}
    assert not formed, formed


# ---- models and the task


def small_models() -> list[tuple[str, nn.Module]]:
    torch.manual_seed(0)
    models: list[tuple[str, nn.Module]] = [
        ("gpt", GPT(vocab_size=V, block_size=32, n_layer=1, n_head=2, n_embd=C))
    ]
    try:
        from trainer.models.hf import causal_lm
    except ImportError:  # pragma: no cover - the hf extra is missing
        return models
    shapes = {"max_position_embeddings": 32, "hidden_size": C, "intermediate_size": 48}
    shapes |= {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    gpt2 = {"n_positions": 32, "n_embd": C, "n_layer": 1, "n_head": 2}
    for family in ("gpt2", "llama", "mistral", "qwen2"):
        config = {"vocab_size": V, **(gpt2 if family == "gpt2" else shapes)}
        config |= {"bos_token_id": None, "eos_token_id": None, "use_cache": False}
        models.append((family, causal_lm(family, config)))
    return models


@pytest.mark.parametrize(
    "name, model", small_models(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_task_on_models_equals_the_plain_loss(name: str, model: nn.Module) -> None:
    """Every model that declares OutputHead: loss and every parameter's gradient (GPT's and
    GPT-2's tied embedding included), through the task's plain (`chunk_size=None`, the loss in
    the forward) and chunked paths, equal `F.cross_entropy` of the model's own logits."""
    model.eval()  # transformers' default configs have dropout
    assert isinstance(model, OutputHead)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(V, (3, 20), generator=g)
    if name == "gpt":
        targets = torch.randint(V, (3, 20), generator=g)
        targets[0, 11:] = -100
        batch: Any = (ids, targets)
    else:
        mask = torch.ones_like(ids)
        mask[0, 11:] = 0  # padding: ignored, and one fewer target per row
        batch = {"input_ids": ids, "attention_mask": mask}
        targets = ids.masked_fill(mask == 0, -100)[:, 1:]
    plain, chunked = CausalLMTask(chunk_size=None), CausalLMTask(7, chunked_vocab_threshold=V)
    assert chunked.chunked(model) and not plain.chunked(model)

    def reference() -> torch.Tensor:
        out = model(ids) if name == "gpt" else model(**batch)
        logits = out if isinstance(out, torch.Tensor) else out.logits  # (3, 20, V)
        if name != "gpt":
            logits = logits[:, :-1]  # position t predicts token t + 1
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    results = []
    for compute in (
        reference,
        lambda: plain.loss_sum(model, batch),
        lambda: chunked.loss_sum(model, batch),
    ):
        model.zero_grad(set_to_none=True)
        loss = compute()
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), *paths = results
    for got, got_grads in paths:
        assert abs(got - want) <= 1e-6 * abs(want), (got, want)
        for n, w in want_grads.items():
            err = (got_grads[n] - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
            assert err <= 1e-5, (n, err)


def test_threshold_keeps_small_vocabularies_on_the_plain_path() -> None:
    tiny = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
    gpt2_sized = GPT(vocab_size=50257, block_size=16, n_layer=1, n_head=2, n_embd=16)
    default = CausalLMTask()
    assert not default.chunked(tiny)  # the byte-level default never changes path
    assert default.chunked(gpt2_sized)
    assert not CausalLMTask(chunk_size=None).chunked(gpt2_sized)
    assert CausalLMTask(chunked_vocab_threshold=256).chunked(tiny)
    # Only a declared output layer: a model that returns logits its own way stays plain.
    assert not CausalLMTask(chunked_vocab_threshold=1).chunked(nn.Linear(4, 50257))
    with pytest.raises(ValueError, match="chunk_size"):
        CausalLMTask(chunk_size=0)
    # chunk_size=auto: from the vocabulary and the device's memory (1/32 of it for the
    # chunk's fp32 logits), a power of two.
    assert auto_chunk_size(50304, 80 * 10**9) == 8192  # GPT-2 on an H100: 1.6 GB of logits
    assert auto_chunk_size(50304, 141 * 10**9) == 16384  # on an H200
    assert auto_chunk_size(128256, 80 * 10**9) == 4096  # Llama 3 on an H100
    assert auto_chunk_size(50304, 2**20) == 256  # never below 256 tokens
    chunk = default.head_loss(gpt2_sized)
    assert isinstance(chunk, ChunkedCrossEntropy)
    # On a CPU the size it had before `auto`, whatever the host's memory: a CPU run's
    # round-off is the same on every machine.
    assert chunk.chunk_size == HOST_CHUNK_SIZE == 2048
    assert chunk_size_for(128256, torch.device("cpu")) == 2048
    assert default.head_loss(gpt2_sized) is chunk  # one object: compile guards on it
    assert isinstance(default.head_loss(tiny), PlainCrossEntropy)
    assert default.head_loss(nn.Linear(4, 50257)) is None  # no declared output layer
    # A head whose forward is not F.linear's would silently change the logits: refused.
    quantized = FakeQuantLinear(C, V, bias=False, bits=4)
    with pytest.raises(ValueError, match="FakeQuantLinear has a forward of its own"):
        ChunkedCrossEntropy(8)(torch.randn(2, 3, C), quantized, torch.zeros(2, 3, dtype=torch.long))


# ---- the compiled graph


@pytest.mark.parametrize("chunk_size", ["null", "auto"])
def test_compiled_gpt_is_one_graph_that_ends_at_the_loss(chunk_size: str) -> None:
    """`train.compile=true` under the gpt2_small preset's bf16, the plain (`task.chunk_size=
    null`) and the chunked path: dynamo captures the GPT's forward and the loss in one graph
    with no break, and recompiles nothing for the next micro-batch; the graph's output is the
    loss itself, so no eager code receives the logits (issue #61: the plain path's graph used
    to end at the logits and leave an fp32 copy of them and the cross-entropy to eager mode,
    18% of nanoGPT's step time on an H200). The value equals the eager model's to round-off.

    The graphs are recorded by a backend that keeps dynamo's graph and runs it as traced:
    what inductor would compile, without inductor's minute of compiling."""
    overrides = ["model=gpt_tiny", "model.n_layer=1", "train.compile=true"]
    overrides += ["train.precision=bf16", f"task.chunk_size={chunk_size}"]
    cfg, _ = to_config(compose_config([*overrides, "task.chunked_vocab_threshold=256"]))
    spec = {k: v for k, v in cfg.model.items() if k[0] != "_" and k != "activation_checkpointing"}
    torch.manual_seed(0)
    model = GPT(**spec)
    task = build_task(cfg.task)
    assert task.chunked(model) == (chunk_size == "auto")  # premise: both paths
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(256, (4, 64), generator=g) for _ in "xy") for _ in "ab"]
    targets = batches[0][1].clone()
    targets[0, 40:] = -100  # padding
    batches[0] = (batches[0][0], targets)
    precision = Precision(cfg.train.precision, "cpu")
    with precision.autocast():
        want = [task.loss_sum(model, b).item() for b in batches]  # eager

    graphs, got, breaks, frames = compile_and_record(model, task, batches, precision)
    assert not breaks, f"graph breaks: {breaks}"
    assert len(graphs) == 1 and frames.get("ok") == 1, (len(graphs), frames)
    (output,) = next(n for n in graphs[0].graph.nodes if n.op == "output").args[0]
    result = output.meta["example_value"]
    assert result.dim() == 0, f"the graph returns {tuple(result.shape)}, not the loss"
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


# ---- the real trainer

SEED_ARGS = [
    "model=gpt_tiny",
    "model.vocab_size=1024",  # byte data, a vocabulary 4x larger than it needs
    "logger=none",
    "data.packed=false",  # padded micro-batches: ignored targets
    "data.block_size=32",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    "train.max_steps=3",
    "train.log_every=1",
    "eval.every_steps=3",
    "eval.max_batches=2",
    "eval.sample_tokens=0",
    "checkpoint.every_steps=0",
    "scheduler.warmup_steps=1",
    "task.chunked_vocab_threshold=1024",
]
CHUNKED = ["task.chunk_size=37"]  # does not divide a micro-batch's 4 x 31..32 tokens
PLAIN = ["task.chunk_size=null"]


def by_step(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("chunked")
    text = stdlib_text(root / "text.py", 120_000)
    base = [*SEED_ARGS, f"data.path={text}"]
    two = ["train.micro_batch_size=2"]  # x 2 ranks: the same global batch of 8 per micro step

    def cmd(args: list[str], run_dir: Path) -> list[str]:
        return [*torchrun_cmd(2), "-m", "trainer.train", *args, f"hydra.run.dir={run_dir}"]

    procs = launch_all(
        {
            "ddp": cmd([*base, *CHUNKED, *two], root / "ddp"),
            "fsdp": cmd([*base, *CHUNKED, *two, "dist.strategy=fsdp"], root / "fsdp"),
        },
        timeout=240.0,
    )
    runs = {
        name: train_in_process([*base, *args], root / name)
        for name, args in (("plain", PLAIN), ("chunked", CHUNKED))
    }
    return {"root": root, "procs": procs, "runs": runs}


@pytest.mark.multiproc
def test_trainer_chunked_run_equals_the_plain_run(trainer_runs: dict[str, Any]) -> None:
    # Premise: the config's task takes the chunked path for this model, the plain one not.
    cfg, _ = to_config(compose_config([*SEED_ARGS, *CHUNKED]))
    model = GPT(
        **{k: v for k, v in cfg.model.items() if k[0] != "_" and k != "activation_checkpointing"}
    )
    assert build_task(cfg.task).chunked(model)
    assert not build_task(to_config(compose_config([*SEED_ARGS, *PLAIN]))[0].task).chunked(model)
    plain, chunked = trainer_runs["runs"]["plain"], trainer_runs["runs"]["chunked"]
    for key in ("train/loss", "train/grad_norm", "val/loss"):
        want, got = by_step(plain, key), by_step(chunked, key)
        assert sorted(want) == sorted(got) and want, (key, want, got)
        for step in want:
            assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (key, step, got, want)
    # Premise: padding made micro-batches' valid-token counts differ, so an inexact
    # ignore_index handling would show.
    assert by_step(plain, "train/loss")[1] > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_chunked_equal_one_process(trainer_runs: dict[str, Any], strategy: str) -> None:
    """Through DDP's and FSDP's forward: gradients are synchronized (steps 2 and 3 would
    drift apart otherwise) and the tied output layer's gradient arrives once."""
    proc = trainer_runs["procs"][strategy]
    assert proc.returncode == 0, explain(proc)
    want = by_step(train_records(trainer_runs["runs"]["chunked"]), "train/loss")
    got = by_step(train_records(read_metrics(trainer_runs["root"] / strategy)), "train/loss")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
