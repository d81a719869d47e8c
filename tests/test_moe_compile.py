"""A mixture of experts under `train.compile=true` (issue #65): one graph whatever the routing.

The dispatch keeps the counts per expert on the device and the experts run as grouped
products (engine/moe/grouped.py): `torch._grouped_mm` where it runs, one matmul per expert
(`loop_mm`, an operator torch.compile does not look into) where it cannot. Before, the
dispatch read the counts on the host (`bincount(...).tolist()`): dynamo cut the graph there
and recompiled the frame after it for each new pattern of counts, until its recompile limit
made it run that frame eagerly.

- The grouped kernel and the loop give the same products and gradients in float32 (against a
  float64 per-expert reference computed here), an empty expert's gradient zero.
- The loop serves what the kernel refuses (float64, widths that are not 16-byte multiples,
  strides, float32 while tracing: torch 2.13 traces the kernel in bfloat16 only), exactly in
  float64.
- The in-tree GPT with 4 experts, top-2, moe.hidden=64 (the issue's) compiles into one graph,
  without a break, for micro-batches each routed differently, in fp32 (the loop) and bf16
  (the kernel); its losses are eager's.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.moe.grouped import group_offsets, grouped_mm, loop_mm, loop_reason
from engine.numerics.precision import Precision
from tests.conftest import compile_and_record, compose_config, in_tree_model
from trainer.config.cli import to_config
from trainer.models.gpt import GPT
from trainer.run.assemble import build_task

COUNTS = [5, 0, 11, 16]  # rows per expert; expert 1 gets none
K, N = 16, 24


def problem(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Rows (M, K) sorted by expert, weights (E, K, N), an upstream gradient (M, N)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), K, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(len(COUNTS), K, N, generator=g, dtype=dtype).requires_grad_()
    grad = torch.randn(sum(COUNTS), N, generator=g, dtype=dtype)
    return x, w, grad


def per_expert(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """The reference in float64: each expert's slice times its weight, and the gradients."""
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y = torch.cat([part @ w64[e] for e, part in enumerate(torch.split(x64, COUNTS))])
    return [y, *torch.autograd.grad(y, (x64, w64), grad.double())]


def products(fn: object, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> list:
    y = fn(x, w, group_offsets(COUNTS, x.device))  # type: ignore[operator]
    return [y, *torch.autograd.grad(y, (x, w), grad)]


def test_grouped_kernel_equals_the_loop() -> None:
    """float32: torch._grouped_mm (what an eager float32 mixture runs) and the loop (what
    float64 and compiled float32 run) agree with each other to round-off and with the float64
    per-expert product; the empty expert's weight gradient is zero."""
    x, w, grad = problem(torch.float32)
    assert loop_reason(x, w) is None  # premise: the kernel runs it
    kernel = products(grouped_mm, x, w, grad)
    loop = products(loop_mm, x, w, grad)
    want = per_expert(x, w, grad)
    for got_kernel, got_loop, ref in zip(kernel, loop, want):
        torch.testing.assert_close(got_kernel, got_loop, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_kernel.double(), ref, rtol=1e-5, atol=1e-5)
    assert not kernel[2][1].any() and not loop[2][1].any()  # expert 1: no rows, no gradient


def test_the_loop_serves_what_the_kernel_refuses() -> None:
    """float64 (exactly the per-expert product), widths of other than 16-byte multiples,
    strides the kernel refuses, float32 while tracing (torch 2.13's shape function of
    torch._grouped_mm takes bfloat16 only); the loop operator's fake and autograd
    registrations hold (torch.library.opcheck)."""
    x, w, grad = problem(torch.float64)
    assert "float64" in (loop_reason(x, w) or "")
    got, want = products(grouped_mm, x, w, grad), per_expert(x, w, grad)
    for a, b in zip(got, want):
        assert torch.equal(a, b)  # the same matmuls
    x32, w32 = x.detach().float(), w.detach().float()
    assert "16-byte" in (loop_reason(x32[:, :6], w32[:, :6]) or "")  # 24-byte rows
    assert "strides" in (loop_reason(x32[:, ::2], w32[:, ::2]) or "")  # every other column
    with FakeTensorMode():
        fake_x, fake_w = torch.empty(32, K), torch.empty(4, K, N)
        assert "bfloat16 only" in (loop_reason(fake_x, fake_w) or "")
        assert loop_reason(fake_x.bfloat16(), fake_w.bfloat16()) is None
    offsets = group_offsets(COUNTS, x.device)
    torch.library.opcheck(loop_mm, (x32.requires_grad_(), w32.requires_grad_(), offsets))


@pytest.mark.parametrize(("precision", "op"), [("fp32", "loop_mm"), ("bf16", "_grouped_mm")])
def test_compiled_mixture_is_one_graph_whatever_the_routing(precision: str, op: str) -> None:
    """gpt_tiny (one block) with 4 experts, top-2, moe.hidden=64 (issue #65's), compiled:
    dynamo captures the forward and the loss in one graph with no break, and 6 micro-batches,
    each routed to the experts in other counts, compile nothing more (before: a break at the
    dispatch in every mixture layer, and a recompile of the frame after it for each new
    pattern). fp32 runs the loop operator, bf16 torch._grouped_mm itself, both in the graph.
    The losses are eager's.

    The graphs are recorded by a backend that keeps dynamo's graph and runs it as traced:
    what inductor would compile, without inductor's minute of compiling."""
    moe = ["+model.moe.experts=4", "+model.moe.top_k=2", "+model.moe.hidden=64"]
    overrides = ["model=gpt_tiny", "model.n_layer=1", *moe, "train.compile=true"]
    overrides.append(f"train.precision={precision}")
    cfg, _ = to_config(compose_config(overrides))
    spec = {k: v for k, v in cfg.model.items() if k[0] != "_" and k != "activation_checkpointing"}
    torch.manual_seed(0)
    model = GPT(**spec)
    task = build_task(cfg.task)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(256, (8, 64), generator=g) for _ in "xy") for _ in range(6)]
    prec = Precision(precision, "cpu")
    want, patterns = [], set()
    with prec.autocast():
        for b in batches:  # eager
            want.append(task.loss_sum(model, b).item())
            routed = [r.routing.experts.flatten() for r in model.routers()]  # type: ignore[union-attr]
            patterns.add(tuple(tuple(e.bincount(minlength=4).tolist()) for e in routed))
    assert len(patterns) == len(batches)  # premise: every micro-batch routes otherwise

    graphs, got, breaks, frames = compile_and_record(model, task, batches, prec)
    assert not breaks, f"graph breaks: {breaks}"
    assert len(graphs) == 1 and frames == {"total": 1, "ok": 1}, (len(graphs), frames)
    ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(op in target for target in ops) == 2 * spec["n_layer"], ops  # fc, proj
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-6 * abs(b), (got, want)


def test_compiled_transformers_mixture_is_one_graph() -> None:
    """model=hf_qwen3_moe (one decoder layer, 8 experts top-2) compiled: dynamo captures the
    forward and the loss in one graph with no break for 4 micro-batches, each routed
    differently; the experts run transformers' own `grouped_mm` forward (in fp32 its loop
    operator, in the graph: up and down); the losses are eager's. Before: transformers chose
    its eager experts for cumulus's subclass (it reads the source of the class's module), whose
    loop over the experts hit breaks the graph at `nonzero`."""
    pytest.importorskip("transformers")
    from trainer.models.hf import causal_lm

    node = in_tree_model("hf_qwen3_moe")
    cfg, _ = to_config(compose_config(["model=hf_qwen3_moe", "train.compile=true"]))
    torch.manual_seed(0)
    model = causal_lm(node["family"], {**node["config"], "num_hidden_layers": 1})
    task = build_task(cfg.task)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(256, (4, 32), generator=g) for _ in "xy") for _ in range(4)]
    prec = Precision("fp32", "cpu")
    want = [task.loss_sum(model, b).item() for b in batches]  # eager

    graphs, got, breaks, frames = compile_and_record(model, task, batches, prec)
    assert not breaks, f"graph breaks: {breaks}"
    # Two frames: the model's forward, and its pre-hook (use_cache off), which holds no graph.
    assert len(graphs) == 1 and frames == {"total": 2, "ok": 2}, (len(graphs), frames)
    ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("grouped_mm_fallback" in target for target in ops) == 2, ops  # up, down
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-6 * abs(b), (got, want)
