"""Exact cross-entropy over a large vocabulary without the logits of the whole micro-batch.

A language model's last layer maps N hidden states (N, C) to logits (N, V). At GPT-2's
vocabulary (V = 50,257) and 16 x 1024 tokens those logits are 3.3 GB in fp32, and the plain
loss keeps them (and their gradient) alive. Here the tokens go through the output layer a
chunk at a time: each chunk's logits (chunk, V) give its log-sum-exp, its loss and, when a
gradient is wanted, `softmax - onehot` right away, from which the chunk's share of the
gradients of the hidden states and of the output layer is formed before the next chunk. No
logit is recomputed in backward: backward only multiplies the stored gradients by the scalar
that reaches the loss. Peak extra memory is O(chunk x V) instead of O(N x V); the result is
the same sum over valid tokens as `F.cross_entropy(..., reduction="sum")`, to round-off.

Precision follows the plain path: under autocast the matmuls run in the autocast dtype, the
log-sum-exp, the loss and the accumulated gradients in fp32 (float64 stays float64).

A model opts in by declaring `OutputHead` (engine/tasks.py's `CausalLMTask` then passes
`head_loss=` and `head_targets=` through the model's own forward, so DDP's and FSDP's hooks
and torch.compile see the whole computation). Below the vocabulary threshold, or with
`chunk_size=None`, the loss passed is `PlainCrossEntropy`: the whole micro-batch's logits, but
still inside the forward, so a compiled model's graph ends at the loss, not at the logits.

The chunk size on a CUDA device (`auto_chunk_size`): the largest power of two of tokens whose
fp32 logits (chunk x V x 4 bytes) take at most 1/32 of the device's memory; on a CPU 2048,
whatever the host's memory (`chunk_size_for`). GPT-2's vocabulary (50,304)
gets 8,192 tokens on an 80 GB H100 (1.6 GB of logits), 16,384 on a 141 GB H200; Llama 3's
(128,256) 4,096 on an H100. Larger chunks mean fewer, larger matmuls (on an H200,
`task.chunk_size=8192` was 2.6% faster than 2048 and 512 3.6% slower than 2048: issue #61).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

IGNORE_INDEX = -100
# The share of the device's memory one chunk's fp32 logits may take (auto_chunk_size).
CHUNK_MEMORY_SHARE = 32
# `auto` off a CUDA device: the fixed size it had before `auto`, so that a CPU run's
# round-off (and its bit-exact resume elsewhere) does not depend on the host's memory.
HOST_CHUNK_SIZE = 2048


class HeadLoss(Protocol):
    """What a model calls in place of its output layer: (hidden, head, targets) -> loss."""

    def __call__(
        self, hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class OutputHead(Protocol):
    """A causal LM whose logits are exactly `output_head()(final hidden states)`.

    Declaring it promises that `forward(inputs, head_loss=fn, head_targets=targets)` returns
    `fn(hidden (B, T, C), self.output_head(), targets (B, T))` instead of the logits, from
    the same hidden states the logits would be computed from (trainer/models/gpt.py and
    trainer/models/hf.py implement it).
    """

    def output_head(self) -> nn.Linear: ...


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the plain `head(hidden)` would multiply in: autocast's for fp32/bf16/fp16
    inputs, else the inputs' own (autocast leaves float64 alone)."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    device = hidden.device.type
    if dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return dtype


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Loss sum and, in the same pass, its gradients; backward scales them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        compute_dtype: torch.dtype,
        wants: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        # hidden (N, C), weight (V, C), bias (V,) or None, targets (N,)
        acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
        n = hidden.size(0)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            valid = targets != ignore_index  # (N,)
            safe = targets.masked_fill(~valid, 0)  # ignored rows index class 0, masked below
            loss = torch.zeros((), dtype=acc, device=hidden.device)
            # Only the gradients backward will be asked for: (N, C), (V, C), (V,).
            grad_h = torch.empty(hidden.shape, dtype=acc, device=h.device) if wants[0] else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=w.device) if wants[1] else None
            grad_b = torch.zeros(bias.shape, dtype=acc, device=w.device) if wants[2] else None
            for start in range(0, n, chunk_size):
                rows = slice(start, start + chunk_size)
                h_c, t_c, v_c = h[rows], safe[rows], valid[rows]
                logits = F.linear(h_c, w, b).to(acc)  # (n_c, V)
                lse = torch.logsumexp(logits, dim=-1)  # (n_c,)
                picked = logits.gather(1, t_c[:, None]).squeeze(1)  # (n_c,)
                loss = loss + torch.where(v_c, lse - picked, 0.0).sum()
                if not any(wants):
                    continue
                # d loss / d logits = softmax - onehot: (n_c, V), in place over the logits. Its
                # ignored rows are zeroed on the (n_c, C) side of the products, not here.
                g = logits.sub_(lse[:, None]).exp_()
                g.scatter_add_(1, t_c[:, None], torch.full_like(lse[:, None], -1.0))
                g_low = g.to(compute_dtype)  # the plain path's matmuls take this dtype too
                keep = v_c[:, None].to(compute_dtype)  # (n_c, 1): 1 valid, 0 ignored
                if grad_h is not None:
                    grad_h[rows] = (g_low @ w).mul_(keep)  # (n_c, C)
                if grad_w is not None and compute_dtype == acc:
                    grad_w.addmm_(g_low.t(), h_c * keep)  # (V, C)
                elif grad_w is not None:  # each chunk's low-precision product summed in fp32
                    grad_w += (g_low.t() @ (h_c * keep)).to(acc)
                if grad_b is not None:
                    grad_b += (keep.t().to(acc) @ g).squeeze(0)  # (V,)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = [
            None if grad is None else (grad * grad_loss).to(dtype)
            for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes)
        ]
        return (*grads, None, None, None, None, None)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = 2048,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Sum over the tokens whose target is not `ignore_index` of the cross-entropy of
    `hidden @ weight.T + bias` against `targets`, `chunk_size` tokens at a time.

    Equals `F.cross_entropy(F.linear(hidden, weight, bias), targets, ignore_index=...,
    reduction="sum")` (logits in fp32) in value and gradients (wrt hidden, weight, bias) to
    round-off, without ever holding more than (chunk_size, V) logits. Not twice
    differentiable.

    Args:
        hidden: (N, C) final hidden states.
        weight: (V, C) output layer weight (may be tied to the input embedding).
        targets: (N,) class indices, `ignore_index` where a token is no loss item.
        bias: (V,) or None.
        chunk_size: tokens per chunk; the last chunk may be shorter.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_cross_entropy: hidden must be (N, C) and targets (N,), got "
            f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    grad = torch.is_grad_enabled()
    wants = tuple(grad and t is not None and t.requires_grad for t in (hidden, weight, bias))
    dtype = _compute_dtype(hidden, weight)
    return _ChunkedCrossEntropy.apply(
        hidden, weight, bias, targets, chunk_size, ignore_index, dtype, wants
    )


def check_head(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, what: str) -> None:
    """A declared output head `what` computes as F.linear(hidden, weight, bias): a plain
    Linear, and hidden states of (*targets.shape, C)."""
    if type(head).forward is not nn.Linear.forward:  # e.g. fake-quantized weights
        raise ValueError(
            f"{what} computes the output layer as F.linear(hidden, weight, bias); "
            f"{type(head).__name__} has a forward of its own, so its logits may differ. "
            "Do not declare output_head() for it, or set task.chunk_size=null"
        )
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"the model's hidden states have shape {tuple(hidden.shape)}, which does not fit "
            f"targets of shape {tuple(targets.shape)}: they must be (*targets.shape, C)"
        )


@dataclass(frozen=True)
class ChunkedCrossEntropy:
    """The `HeadLoss` a causal LM task passes to a model's forward: one object per run, so
    torch.compile sees the same one every step."""

    chunk_size: int = 2048
    ignore_index: int = IGNORE_INDEX

    def __call__(
        self, hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor
    ) -> torch.Tensor:
        check_head(hidden, head, targets, "the chunked loss")
        return chunked_cross_entropy(
            hidden.flatten(0, -2),  # (N, C)
            head.weight,
            targets.flatten(),  # (N,)
            bias=head.bias,
            chunk_size=self.chunk_size,
            ignore_index=self.ignore_index,
        )


@dataclass(frozen=True)
class PlainCrossEntropy:
    """The `HeadLoss` of the whole micro-batch's logits: `F.cross_entropy` of `head(hidden)`
    in fp32 (float64 stays float64), summed over targets that are not `ignore_index`. The same
    operations as the task's plain path, but inside the model's forward: a compiled model
    fuses the loss with its output layer instead of handing eager code its logits."""

    ignore_index: int = IGNORE_INDEX

    def __call__(
        self, hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor
    ) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(
                f"the model's hidden states have shape {tuple(hidden.shape)}, which does not fit "
                f"targets of shape {tuple(targets.shape)}: they must be (*targets.shape, C)"
            )
        logits = head(hidden)  # (B, T, V)
        if logits.dtype != torch.float64:  # softmax in fp32 even under autocast
            logits = logits.float()
        return F.cross_entropy(
            logits.flatten(0, -2),  # (N, V)
            targets.flatten(),  # (N,)
            ignore_index=self.ignore_index,
            reduction="sum",
        )


def device_memory(device: torch.device) -> int:
    """Bytes of memory of `device`: a CUDA device's own, else the host's physical memory."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def chunk_size_for(vocab: int, device: torch.device) -> int:
    """`chunk_size=auto`: from a CUDA device's memory (`auto_chunk_size`); `HOST_CHUNK_SIZE`
    elsewhere."""
    if device.type == "cuda":
        return auto_chunk_size(vocab, device_memory(device))
    return HOST_CHUNK_SIZE


def auto_chunk_size(vocab: int, memory: int) -> int:
    """Tokens per chunk of the chunked loss: the largest power of two whose fp32 logits
    (chunk x `vocab` x 4 bytes) take at most 1/`CHUNK_MEMORY_SHARE` of `memory` bytes; at
    least 256.

    Example: GPT-2's vocabulary on an 80 GB H100: `auto_chunk_size(50304, 80 * 10**9)` is 8192.
    """
    tokens = memory // CHUNK_MEMORY_SHARE // (4 * vocab)
    return max(256, 1 << max(tokens, 1).bit_length() - 1)


# ---- per-token log-probabilities (task=dpo, task=grpo) -------------------------------------
# A preference loss needs log p(label) of every answer token, each row's sum weighted by its
# own pair's gradient, not one sum: the gradient reaching the logits is not a single scalar
# times `softmax - onehot`, so it cannot be formed in the forward as the loss's is. The
# forward keeps each token's log-sum-exp (N,) instead; backward recomputes a chunk's logits at
# a time (from the hidden states, or reads them from the model's logits) and forms its share.
# With `with_entropy` the forward also gives each token's entropy of its whole distribution,
# H = lse - sum(softmax * logits), from the chunk's logits it holds anyway (task=grpo's record;
# not differentiable).


def _chunk_entropy(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(n_c,) entropy of each row of `logits` (n_c, V) given its log-sum-exp (n_c,)."""
    probs = (logits - lse[:, None]).exp_()
    return lse - (probs * logits).sum(-1)


class _HeadLogProbs(torch.autograd.Function):
    """log p(target) per token from hidden states and the output layer, a chunk at a time;
    backward recomputes each chunk's logits (one more (chunk, C) x (C, V) product)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        compute_dtype: torch.dtype,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden (N, C), weight (V, C), bias (V,) or None, targets (N,)
        acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            valid = targets != ignore_index  # (N,)
            safe = targets.masked_fill(~valid, 0)
            out = torch.empty(hidden.shape[:1], dtype=acc, device=hidden.device)  # (N,)
            lse = torch.empty_like(out)  # (N,)
            entropy = torch.zeros_like(out) if with_entropy else out.new_zeros(0)
            for start in range(0, hidden.size(0), chunk_size):
                rows = slice(start, start + chunk_size)
                logits = F.linear(h[rows], w, b).to(acc)  # (n_c, V)
                lse[rows] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, safe[rows, None]).squeeze(1)  # (n_c,)
                out[rows] = torch.where(valid[rows], picked - lse[rows], 0.0)
                if with_entropy:
                    entropy[rows] = torch.where(valid[rows], _chunk_entropy(logits, lse[rows]), 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        ctx.setup = (chunk_size, compute_dtype)
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        del grad_entropy  # the entropy is a record, not differentiable
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        chunk_size, compute_dtype = ctx.setup
        wants = ctx.needs_input_grad[:3]
        acc = lse.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            scale = torch.where(valid, grad_out.to(acc), 0.0)  # (N,): ignored tokens give 0
            grad_h = torch.empty(hidden.shape, dtype=acc, device=h.device) if wants[0] else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=w.device) if wants[1] else None
            grad_b = torch.zeros(bias.shape, dtype=acc, device=w.device) if wants[2] else None
            for start in range(0, hidden.size(0), chunk_size):
                rows = slice(start, start + chunk_size)
                s_c = scale[rows, None]  # (n_c, 1)
                # d out / d logits = onehot - softmax, times each token's incoming gradient
                g = F.linear(h[rows], w, b).to(acc).sub_(lse[rows, None]).exp_().mul_(-s_c)
                g.scatter_add_(1, safe[rows, None], s_c)  # (n_c, V)
                g_low = g.to(compute_dtype)
                if grad_h is not None:
                    grad_h[rows] = g_low @ w  # (n_c, C)
                if grad_w is not None and compute_dtype == acc:
                    grad_w.addmm_(g_low.t(), h[rows])  # (V, C)
                elif grad_w is not None:
                    grad_w += (g_low.t() @ h[rows]).to(acc)
                if grad_b is not None:
                    grad_b += g.sum(0)  # (V,)
        grads = [
            None if grad is None else grad.to(t.dtype)
            for grad, t in zip((grad_h, grad_w, grad_b), (hidden, weight, bias))
        ]
        return (*grads, None, None, None, None, None)


def chunked_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = 2048,
    ignore_index: int = IGNORE_INDEX,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) per token, (N,), of `hidden @ weight.T + bias`, `chunk_size` tokens at a
    time; 0 where the target is `ignore_index`. With `with_entropy`: also each token's entropy
    of its whole distribution, (N,), not differentiable (0 where ignored).

    Equals `F.linear(hidden, weight, bias).float().log_softmax(-1).gather(...)` in value and
    gradients to round-off, without ever holding more than (chunk_size, V) logits (forward and
    backward). Precision as `chunked_cross_entropy`: the products in autocast's dtype, the
    log-sum-exp and the gradients in fp32 (float64 stays float64). Not twice differentiable.

    Args:
        hidden: (N, C) final hidden states.
        weight: (V, C) output layer weight.
        targets: (N,) class indices, `ignore_index` where a token is not scored.
        bias: (V,) or None.
        chunk_size: tokens per chunk; the last chunk may be shorter.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_log_probs: hidden must be (N, C) and targets (N,), got "
            f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    dtype = _compute_dtype(hidden, weight)
    out, entropy = _HeadLogProbs.apply(
        hidden, weight, bias, targets, chunk_size, ignore_index, dtype, with_entropy
    )
    return (out, entropy) if with_entropy else out


@dataclass(frozen=True)
class ChunkedLogProbs:
    """The `HeadLoss` task=dpo and task=grpo pass to a model's forward: each token's log
    p(target), (*targets.shape), from `chunked_log_probs`; the logits are never held whole.
    `with_entropy`: log p and each token's entropy stacked, (*targets.shape, 2) (the entropy
    not differentiable)."""

    chunk_size: int = 2048
    ignore_index: int = IGNORE_INDEX
    with_entropy: bool = False

    def __call__(
        self, hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor
    ) -> torch.Tensor:
        check_head(hidden, head, targets, "the chunked log-probability route")
        out = chunked_log_probs(
            hidden.flatten(0, -2),  # (N, C)
            head.weight,
            targets.flatten(),  # (N,)
            bias=head.bias,
            chunk_size=self.chunk_size,
            ignore_index=self.ignore_index,
            with_entropy=self.with_entropy,
        )
        if isinstance(out, tuple):  # (N,) each -> (*targets.shape, 2)
            return torch.stack(out, -1).view(*targets.shape, 2)
        return out.view(targets.shape)


class _LogitLogProbs(torch.autograd.Function):
    """log p(target) per token from given logits, a chunk of tokens at a time in fp32: no
    fp32 copy nor log-softmax of the whole tensor; backward forms the logits' gradient (in
    their dtype) a chunk at a time from the kept log-sum-exps."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # logits (N, V), targets (N,)
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        with torch.autocast(logits.device.type, enabled=False):
            valid = targets != ignore_index
            safe = targets.masked_fill(~valid, 0)
            out = torch.empty(logits.shape[:1], dtype=acc, device=logits.device)  # (N,)
            lse = torch.empty_like(out)
            entropy = torch.zeros_like(out) if with_entropy else out.new_zeros(0)
            for start in range(0, logits.size(0), chunk_size):
                rows = slice(start, start + chunk_size)
                chunk = logits[rows].to(acc)  # (n_c, V)
                lse[rows] = torch.logsumexp(chunk, dim=-1)
                picked = chunk.gather(1, safe[rows, None]).squeeze(1)
                out[rows] = torch.where(valid[rows], picked - lse[rows], 0.0)
                if with_entropy:
                    entropy[rows] = torch.where(valid[rows], _chunk_entropy(chunk, lse[rows]), 0.0)
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        del grad_entropy  # the entropy is a record, not differentiable
        logits, safe, valid, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # (N, V), the logits' dtype
        with torch.autocast(logits.device.type, enabled=False):
            scale = torch.where(valid, grad_out.to(lse.dtype), 0.0)  # (N,)
            for start in range(0, logits.size(0), ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                s_c = scale[rows, None]
                # Formed in the gradient's own rows when it has the accumulation's dtype (no
                # chunk-sized temporary), never over the saved logits themselves.
                g = grad[rows] if grad.dtype == lse.dtype else None
                g = torch.sub(logits[rows].to(lse.dtype), lse[rows, None], out=g)
                g.exp_().mul_(-s_c).scatter_add_(1, safe[rows, None], s_c)  # onehot - softmax
                if g.dtype != grad.dtype:
                    grad[rows] = g
        return grad, None, None, None, None


def log_probs_in_chunks(
    logits: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 2048,
    ignore_index: int = IGNORE_INDEX,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) per position, (*targets.shape), of `logits` (*targets.shape, V), computed
    `chunk_size` positions at a time in fp32 (float64 stays float64); 0 where the target is
    `ignore_index`. The value and gradient of `logits.float().log_softmax(-1).gather(...)` to
    round-off, with no fp32 copy or log-softmax of the whole tensor: for a model whose output
    layer is not declared (`OutputHead`), whose logits are then held anyway. With
    `with_entropy`: also each position's entropy, (*targets.shape), not differentiable."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"log_probs_in_chunks: logits must be (*targets.shape, V), got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat, entropy = _LogitLogProbs.apply(
        logits.flatten(0, -2), targets.flatten(), chunk_size, ignore_index, with_entropy
    )
    if with_entropy:
        return flat.view(targets.shape), entropy.view(targets.shape)
    return flat.view(targets.shape)
