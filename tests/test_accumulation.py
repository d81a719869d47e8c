"""Exact gradient accumulation: one window of micro 4 x accum 4 through the engine must give
the gradient of the whole 16-sample batch's mean loss, packed or not.

The reference is independent of the code under test: the same 16 samples padded into ONE batch
by the test itself, plain `F.cross_entropy(..., reduction="mean")` and `.backward()` on a deep
copy of the same model. Only the engine side uses the trainer's pieces (GPT, task, collate,
Precision, StepContext, AccumulateStep).

Why the fp32 comparison uses a float64 reference: two fp32 computations of the same gradient
differ by up to ~2e-6 (max |a-b| / max |b|, worst on LayerNorm weights, whose gradients are
small sums of cancelling terms), so an fp32 reference would make a 1e-6 bound flaky. The
float64 reference of the same weights (fp32 -> fp64 is exact) is the true gradient, so the bound
measures the engine's error alone.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.callbacks import Callback, CallbackList
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.step import StepContext, StepResult, Task
from engine.steps.accumulate import AccumulateStep, count_window
from engine.tasks import CausalLMTask
from trainer.data.text import Batch, Samples, TextCfg, collate, load_splits
from trainer.models.gpt import GPT

BLOCK = 64
MICRO, ACCUM = 4, 4
N_SAMPLES = MICRO * ACCUM
FP32_REL = 1e-6  # the exactness claim in fp32
FP64_REL = 1e-12  # what exact accumulation would give in float64
# Unpacked micro-batch k draws its samples from length bucket k, so the four micro-batches
# hold clearly different numbers of valid tokens (the case where dividing by accum is wrong).
LENGTH_BUCKETS = ((8, 20), (21, 35), (36, 50), (51, BLOCK + 1))

Grads = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- setup helpers


@cache
def _train_samples(packed: bool) -> Samples:
    """The default `stdlib` training split; loaded once per mode (about a second each)."""
    return load_splits(TextCfg(packed=packed, block_size=BLOCK)).train


def pick_samples(packed: bool, seed: int = 0) -> list[torch.Tensor]:
    """16 training samples in micro-batch order: random when packed, by length bucket if not."""
    samples = _train_samples(packed)
    order = np.random.default_rng(seed).permutation(len(samples))
    if packed:
        return [samples[int(i)] for i in order[:N_SAMPLES]]
    lengths = samples.spans[:, 1].numpy()[order]
    picked: list[torch.Tensor] = []
    for lo, hi in LENGTH_BUCKETS:
        hits = order[(lengths >= lo) & (lengths <= hi)][:MICRO]
        assert len(hits) == MICRO, f"stdlib data has too few samples of length {lo}..{hi}"
        picked += [samples[int(i)] for i in hits]
    return picked


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT:
    """gpt_tiny-sized GPT; dropout 0 so every forward is deterministic."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT(vocab_size=256, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    return model.to(dtype)


def engine_window(samples: Sequence[torch.Tensor]) -> list[Batch]:
    """The engine's input: micro-batches of MICRO samples, each padded by the text collate."""
    return [collate(list(samples[k : k + MICRO])) for k in range(0, len(samples), MICRO)]


def valid_tokens(batch: Batch) -> int:
    return int((batch[1] != -100).sum())


# --------------------------------------------------------------------------- the reference


def pad_as_one_batch(samples: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """All samples in one batch, written independently of trainer.data.text.collate: inputs are
    s[:-1], targets s[1:], padded to the longest with 0 / -100."""
    width = max(len(s) for s in samples) - 1
    inputs = torch.zeros(len(samples), width, dtype=torch.int64)
    targets = torch.full((len(samples), width), -100, dtype=torch.int64)
    for row, s in enumerate(samples):
        inputs[row, : len(s) - 1] = s[:-1]
        targets[row, : len(s) - 1] = s[1:]
    return inputs, targets


def reference(
    model: nn.Module, samples: Sequence[torch.Tensor], dtype: torch.dtype = torch.float64
) -> tuple[Grads, float, int]:
    """Gradient of the full batch's mean loss on a deep copy in `dtype`; also the loss and the
    number of valid target tokens."""
    ref = copy.deepcopy(model).to(dtype)
    inputs, targets = pad_as_one_batch(samples)
    logits = ref(inputs)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    return grads, loss.item(), int((targets != -100).sum())


def rel_errors(got: Grads, want: Grads) -> dict[str, float]:
    """Per parameter: max |got - want| / max |want|, computed in float64."""
    assert got.keys() == want.keys()
    errs = {}
    for name, w in want.items():
        w64 = w.double()
        scale = w64.abs().max().item()
        assert scale > 0, f"{name}: reference gradient is all zero, the comparison is vacuous"
        errs[name] = (got[name].double() - w64).abs().max().item() / scale
    return errs


def assert_close_rel(got: Grads, want: Grads, bound: float) -> None:
    errs = rel_errors(got, want)
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= bound, f"{worst}: relative error {errs[worst]:.3e} > {bound:.0e}"


# --------------------------------------------------------------------------- the engine side


class GradCapture(Callback):
    """Clones the engine's accumulated gradients at on_after_backward (before clip and update)."""

    def __init__(self) -> None:
        self.grads: Grads | None = None

    def on_after_backward(self, ctx: StepContext) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in ctx.model.named_parameters()}


class Float64LanguageModelTask(CausalLMTask):
    """The real task without its `.float()` on the logits: isolates the engine's own precision
    from the task's when the model runs in float64."""

    def loss_sum(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
        )


def make_ctx(model: nn.Module, task: Task | None = None) -> tuple[StepContext, GradCapture]:
    """A single-rank fp32 context; SGD with lr=0 so the step leaves the weights alone."""
    capture = GradCapture()
    ctx = StepContext(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        scheduler=None,
        task=task or CausalLMTask(),
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        clip_grad_norm=None,
        callbacks=CallbackList({"capture": capture}),
    )
    return ctx, capture


def engine_step(
    model: nn.Module, window: Sequence[Batch], task: Task | None = None
) -> tuple[StepResult, Grads]:
    """One AccumulateStep; returns its result and the accumulated gradients it produced."""
    ctx, capture = make_ctx(model, task)
    result = AccumulateStep()(ctx, window)
    assert capture.grads is not None, "on_after_backward was never called"
    return result, capture.grads


# --------------------------------------------------------------------------- fp32 exactness


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_fp32_accumulation_equals_full_batch_gradient(packed: bool) -> None:
    """micro 4 x accum 4 gives the full batch's gradient to 1e-6, whatever the token counts."""
    samples = pick_samples(packed)
    window = engine_window(samples)
    counts = [valid_tokens(b) for b in window]
    if packed:
        assert len(set(counts)) == 1, counts  # fixed blocks: equal counts by construction
    else:
        # Otherwise a per-micro-batch mean / accum would also pass and the test proves nothing.
        assert len(set(counts)) == ACCUM, f"micro-batch token counts not all different: {counts}"

    model = make_model()
    want, want_loss, want_count = reference(model, samples)
    result, got = engine_step(model, window)

    assert_close_rel(got, want, FP32_REL)
    assert all(g.dtype == torch.float32 for g in got.values())
    assert int(result.global_count) == want_count == sum(counts)
    assert result.loss_sum.item() / want_count == pytest.approx(want_loss, rel=FP32_REL)
    want_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in want.values()]))
    assert result.grad_norm.item() == pytest.approx(want_norm.item(), rel=FP32_REL)
    assert result.skipped.item() == 0.0


def test_count_window_and_backward_window_alone() -> None:
    """The two building blocks (as a custom strategy would call them) leave the exact gradient
    in `.grad` and return the window's loss sum."""
    samples = pick_samples(packed=False, seed=1)
    window = engine_window(samples)
    model = make_model(seed=1)
    want, want_loss, want_count = reference(model, samples)
    ctx, _ = make_ctx(model)

    global_count = count_window(ctx, window)
    assert global_count.dtype == torch.int64 and int(global_count) == want_count
    loss_sum = ctx.parallel.backward_window(ctx, window, global_count)

    got = {n: p.grad for n, p in model.named_parameters()}
    assert_close_rel(got, want, FP32_REL)
    assert loss_sum.item() / want_count == pytest.approx(want_loss, rel=FP32_REL)


class CountedLM(CausalLMTask):
    """The causal-LM task, counting its forwards."""

    forwards = 0

    def loss_sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.forwards += 1
        return super().loss_sum(model, batch)


def test_a_count_settled_after_the_first_forward_is_the_exact_scale() -> None:
    """A parallelism that takes the count's last sum after the first forward (`SettlesCount`:
    replica groups, so torchft's quorum forms meanwhile) gets it settled once, between
    micro-batch 0's forward and its backward, and the gradient is the whole batch's: its
    pending count holds a wrong value (0) until then."""
    from engine.parallel.base import SettlesCount

    samples = pick_samples(packed=False, seed=2)
    window = engine_window(samples)
    model = make_model(seed=2)
    want, _, want_count = reference(model, samples)
    task = CountedLM()
    ctx, capture = make_ctx(model, task)
    inner = ctx.parallel
    settled_after: list[int] = []

    class Deferring(type(inner)):  # the real single-process parallelism, its count deferred
        def pending_item_count(self, local: torch.Tensor) -> torch.Tensor:
            self.final, self.pending = local.clone(), torch.zeros_like(local)
            return self.pending

        def settle_count(self) -> None:
            if self.pending is not None:
                settled_after.append(task.forwards)
                self.pending.copy_(self.final)
                self.pending = None

    deferring = copy.copy(inner)
    deferring.__class__ = Deferring
    assert isinstance(deferring, SettlesCount)
    ctx.parallel = deferring
    result = AccumulateStep()(ctx, window)

    assert settled_after == [1], settled_after  # after the first forward, once
    assert int(result.global_count) == want_count
    assert capture.grads is not None
    assert_close_rel(capture.grads, want, FP32_REL)


# --------------------------------------------------------------------------- float64


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_float64_end_to_end(packed: bool) -> None:
    """A `.double()` model through the real task and engine stays float64 throughout: the
    gradients and the reported loss sum agree with the float64 full batch to 1e-12."""
    samples = pick_samples(packed)
    model = make_model(dtype=torch.float64)
    want, want_loss, _ = reference(model, samples, torch.float64)
    result, got = engine_step(model, engine_window(samples))

    assert all(g.dtype == torch.float64 for g in got.values())
    assert_close_rel(got, want, FP64_REL)
    assert result.loss_sum.dtype == torch.float64
    assert result.loss_sum.item() / int(result.global_count) == pytest.approx(want_loss, rel=1e-12)


def test_float64_engine_is_exact_when_scale_is_exact() -> None:
    """With a float64 task and a power-of-two token count (1/count is exact in fp32), the
    engine's accumulation itself agrees with the full batch to 1e-12."""
    samples = pick_samples(packed=True)
    window = engine_window(samples)
    count = sum(valid_tokens(b) for b in window)
    assert count & (count - 1) == 0, f"{count} tokens: not a power of two"
    model = make_model(dtype=torch.float64)
    want, _, _ = reference(model, samples, torch.float64)
    _, got = engine_step(model, window, Float64LanguageModelTask())
    assert_close_rel(got, want, FP64_REL)


@pytest.mark.parametrize(
    "task",
    [
        pytest.param(CausalLMTask(), id="real_task"),
        pytest.param(Float64LanguageModelTask(), id="float64_task"),
    ],
)
def test_float64_accumulation_exact(task: Task) -> None:
    """Expected of exact accumulation: float64 end to end agrees with the full batch to 1e-12."""
    samples = pick_samples(packed=False)
    window = engine_window(samples)
    count = sum(valid_tokens(b) for b in window)
    assert count & (count - 1) != 0, "a power-of-two count would hide the fp32 scale"
    model = make_model(dtype=torch.float64)
    want, _, _ = reference(model, samples, torch.float64)
    _, got = engine_step(model, window, task)
    assert_close_rel(got, want, FP64_REL)


# --------------------------------------------------------------------------- sensitivity


def test_textbook_mean_over_accum_is_detected() -> None:
    """Dividing each micro-batch's *mean* loss by accum (the textbook bug) misses the reference
    by far more than 1e-6 on unpacked data, so the exactness tests above can fail."""
    samples = pick_samples(packed=False)
    window = engine_window(samples)
    model = make_model()
    want, _, _ = reference(model, samples)

    buggy = copy.deepcopy(model)
    for inputs, targets in window:
        logits = buggy(inputs)
        mean = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
        )
        (mean / len(window)).backward()
    got = {n: p.grad for n, p in buggy.named_parameters()}

    worst = max(rel_errors(got, want).values())
    assert worst > 1e3 * FP32_REL, f"textbook bug only {worst:.2e} off: the setup is insensitive"


# --------------------------------------------------------------------------- step hygiene


class _Saved:
    """A box for one tensor autograd saved for backward; weak-referenceable, unlike tuples."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorTracker:
    """Boxes every tensor autograd saves, so a test can tell whether any graph is still alive."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[_Saved]] = []

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        box = _Saved(tensor)
        self.refs.append(weakref.ref(box))
        return box

    @staticmethod
    def _unpack(box: _Saved) -> torch.Tensor:
        return box.tensor

    @contextmanager
    def track(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.refs)


def test_step_retains_no_autograd_graph() -> None:
    """Nothing the step returns or leaves behind keeps a graph (or its activations) alive."""
    samples = pick_samples(packed=False)
    model = make_model()
    tracker = SavedTensorTracker()
    with tracker.track():
        result, _ = engine_step(model, engine_window(samples))

    for name in ("loss_sum", "global_count", "grad_norm", "skipped"):
        t = getattr(result, name)
        assert not t.requires_grad and t.grad_fn is None, f"StepResult.{name} is attached"
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.grad_fn is None, name
        assert not p.grad.requires_grad, name
    assert tracker.refs, "the tracker saw no saved tensors: it is not hooked in"
    assert tracker.alive() == 0, f"{tracker.alive()} saved activations still referenced"

    # The tracker itself is sensitive: a graph kept with retain_graph=True stays visible.
    control = SavedTensorTracker()
    with control.track():
        kept = CausalLMTask().loss_sum(model, engine_window(samples)[0])
        kept.backward(retain_graph=True)
    assert control.alive() > 0
    del kept


def test_stale_gradients_do_not_leak_into_the_step() -> None:
    """Whatever `.grad` holds before the step (garbage, NaN, the previous step's gradient) is
    discarded: zero_grad(set_to_none=True) comes first."""
    samples = pick_samples(packed=False)
    window = engine_window(samples)
    model = make_model()
    want, _, _ = reference(model, samples)

    gen = torch.Generator().manual_seed(0)
    for i, p in enumerate(model.parameters()):
        p.grad = 1e3 * torch.randn(p.shape, generator=gen)
        if i == 0:
            p.grad[0] = float("nan")
    ctx, capture = make_ctx(model)
    step = AccumulateStep()
    result = step(ctx, window)
    assert capture.grads is not None
    assert_close_rel(capture.grads, want, FP32_REL)
    assert result.skipped.item() == 0.0

    # Second step on the same window: the first step's gradients are still in `.grad` (lr=0
    # SGD does not clear them) and must not be added to the new ones.
    assert all(p.grad is not None for p in model.parameters())
    step(ctx, window)
    assert_close_rel(capture.grads, want, FP32_REL)


def test_unpacked_text_samples_are_the_paragraphs_as_bytes_split_cuts_them(
    tmp_path: Path,
) -> None:
    """data.packed=false on text files: one sample per paragraph (split after b"\\n\\n", the
    separator kept, the last one running to the file's end), long ones cut at block_size+1,
    short ones dropped, never across files; the same as bytes.split finds them, also for
    runs of blank lines, empty files and files ending in a blank line."""
    import random

    rng = random.Random(0)
    texts = [b"", b"\n\n", b"a\n\n\n\nb", b"x" * 40 + b"\n\n\n" + b"y" * 3]
    texts += [bytes(rng.choice(b"ab\n\n\n") for _ in range(rng.randint(0, 60))) for _ in range(40)]
    for i, text in enumerate(texts):
        (tmp_path / f"f{i:03d}.txt").write_bytes(text)
    block, min_len = 7, 2
    want, offset = [], 0
    for i, text in enumerate(texts):
        if i % 10 == 0:  # every 10th file validates (val_every_nth)
            continue
        pos = 0
        for para in text.split(b"\n\n"):
            end = min(pos + len(para) + 2, len(text))
            want += [(offset + s, min(block + 1, end - s)) for s in range(pos, end, block + 1)]
            pos += len(para) + 2
        offset += len(text)
    want = [(s, n) for s, n in want if n >= min_len]
    cfg = TextCfg(
        path=str(tmp_path), glob="*.txt", packed=False, block_size=block, min_sample_len=min_len
    )
    got = load_splits(cfg).train
    assert got.spans.tolist() == [list(w) for w in want]
