"""Built-in tasks: what turns a batch and a model into a loss *sum* and a count of loss items.

All read the model's output as logits: the output tensor itself, or its `.logits` (Hugging
Face model outputs, dicts). Batches are either tuples `(inputs, targets)` or dicts of model
inputs plus `labels` (the model is called with every key but `labels`, so it never computes
a loss of its own). Targets equal to `IGNORE_INDEX` (-100, the PyTorch and Hugging Face
convention) are not loss items.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import unwrap
from engine.numerics.chunked_ce import (
    IGNORE_INDEX,
    ChunkedCrossEntropy,
    ChunkedLogProbs,
    HeadLoss,
    OutputHead,
    PlainCrossEntropy,
    chunk_size_for,
    log_probs_in_chunks,
)


class TaskOutputError(TypeError):
    """The model's output or the batch does not have the shape a task needs."""


def logits_of(output: Any, task: str) -> torch.Tensor:
    """The logits in a model's output: the tensor itself or its `.logits`."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else None
    logits = getattr(output, "logits", logits)
    if isinstance(logits, torch.Tensor):
        return logits
    kind = type(output).__name__
    if isinstance(output, tuple | list):
        kind += f" of {len(output)} items"
    raise TaskOutputError(
        f"{task} reads logits from the model's output, which must be a tensor or have a "
        f"`.logits` tensor; the model returned a {kind}. Return the logits from forward(), or "
        "bring a task of your own (task._target_=...) that reads this output"
    )


def _split(batch: Any, task: str) -> tuple[Any, torch.Tensor, bool]:
    """(model inputs, targets, inputs are keyword arguments) of a tuple or dict batch."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise TaskOutputError(f"{task}: a dict batch needs `labels`; it has {sorted(batch)}")
        return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"], True
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1], False
    raise TaskOutputError(
        f"{task}: a batch must be a pair (inputs, targets) or a dict with `labels`; got a "
        f"{type(batch).__name__}. Check the dataset's collate_fn"
    )


def _forward(model: nn.Module, inputs: Any, as_kwargs: bool) -> Any:
    return model(**inputs) if as_kwargs else model(inputs)


def _float_logits(logits: torch.Tensor) -> torch.Tensor:
    # Softmax in fp32 even under autocast; a float64 model keeps float64.
    return logits if logits.dtype == torch.float64 else logits.float()


def _check_shapes(logits: torch.Tensor, targets: torch.Tensor, task: str, what: str) -> None:
    if logits.shape[:-1] != targets.shape:
        raise TaskOutputError(
            f"{task}: the model's logits have shape {tuple(logits.shape)}, which does not fit "
            f"{what} of shape {tuple(targets.shape)}: logits must be (*targets.shape, classes)"
        )


ChunkSize = int | Literal["auto"] | None


def check_chunking(chunk_size: ChunkSize, chunked_vocab_threshold: int) -> None:
    """`task.chunk_size` and `task.chunked_vocab_threshold` (task=causal_lm, task=dpo)."""
    if chunk_size != "auto" and chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number, auto or null, got {chunk_size}")
    if chunked_vocab_threshold <= 0:
        raise ValueError(
            f"chunked_vocab_threshold must be a positive number, got {chunked_vocab_threshold}"
        )


def chunked_head(
    model: nn.Module, chunk_size: ChunkSize, chunked_vocab_threshold: int
) -> nn.Linear | None:
    """The output layer of `model` (maybe DDP-, FSDP- or compile-wrapped) when its loss is
    computed from the hidden states a chunk of tokens at a time: the model declares
    `OutputHead`, `chunk_size` is not None and the layer has at least
    `chunked_vocab_threshold` classes; else None."""
    inner = unwrap(model)
    if chunk_size is None or not isinstance(inner, OutputHead):
        return None
    head = inner.output_head()
    return head if head.out_features >= chunked_vocab_threshold else None


def tokens_per_chunk(chunk_size: int | Literal["auto"], vocab: int, device: torch.device) -> int:
    """`chunk_size` as a number: `auto` from the vocabulary and the device (`chunk_size_for`)."""
    return chunk_size if isinstance(chunk_size, int) else chunk_size_for(vocab, device)


class TokenScores(NamedTuple):
    """Per-position scores of a batch's rows: log p(label), (rows, T), differentiable; and,
    when asked for, each position's entropy of its whole distribution, (rows, T), detached.
    Both are 0 where the label is `IGNORE_INDEX`."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None


class TokenLogProbs:
    """log p(label) of each position, in fp32 (float64 stays float64): the one path of every
    task that scores answer tokens one by one (task=dpo's policy, reference and precompute
    pass; task=grpo's policy, old policy and reference).

    A model that declares `OutputHead` with at least `chunked_vocab_threshold` classes gets
    `ChunkedLogProbs` as its `head_loss`, so its (rows, T, V) logits are never held; any other
    model's logits are read `chunk_size` positions at a time (`log_probs_in_chunks`);
    `chunk_size=None` takes the whole fp32 log-softmax of the logits. `task`: the task's name,
    for errors."""

    def __init__(self, chunk_size: ChunkSize, chunked_vocab_threshold: int, task: str) -> None:
        check_chunking(chunk_size, chunked_vocab_threshold)
        self.chunk_size, self.chunked_vocab_threshold = chunk_size, chunked_vocab_threshold
        self.task = task
        # One per vocabulary, device and output for the whole run, as task=causal_lm's
        # (torch.compile guards on the object a forward is given).
        self._heads: dict[tuple[int, torch.device, bool], ChunkedLogProbs] = {}

    def __call__(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        labels: torch.Tensor,
        rest: Mapping[str, Any],
        with_entropy: bool = False,
    ) -> TokenScores:
        """The scores of `labels` (rows, T) under `model` called with `input_ids=ids` and
        `rest` (its other inputs)."""
        head = chunked_head(model, self.chunk_size, self.chunked_vocab_threshold)
        if head is not None:  # from the hidden states: no (rows, T, V) logits at all
            return self._from_head(model, head, ids, labels, rest, with_entropy)
        logits = logits_of(model(input_ids=ids, **rest), self.task)  # (rows, T, V)
        if self.chunk_size is not None:
            chunk = tokens_per_chunk(self.chunk_size, logits.size(-1), logits.device)
            out = log_probs_in_chunks(logits, labels, chunk, with_entropy=with_entropy)
            return TokenScores(*out) if isinstance(out, tuple) else TokenScores(out)
        if logits.dtype != torch.float64:
            logits = logits.float()  # log-softmax in fp32 even under autocast
        log_softmax = logits.log_softmax(-1)  # (rows, T, V)
        picked = log_softmax.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        valid = labels != IGNORE_INDEX
        picked = torch.where(valid, picked, 0.0)
        if not with_entropy:
            return TokenScores(picked)
        with torch.no_grad():
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        return TokenScores(picked, torch.where(valid, entropy, 0.0))

    def _from_head(
        self,
        model: nn.Module,
        head: nn.Linear,
        ids: torch.Tensor,
        labels: torch.Tensor,
        rest: Mapping[str, Any],
        with_entropy: bool,
    ) -> TokenScores:
        key = (head.out_features, head.weight.device, with_entropy)
        if key not in self._heads:
            chunk = tokens_per_chunk(self.chunk_size, head.out_features, head.weight.device)
            self._heads[key] = ChunkedLogProbs(chunk, with_entropy=with_entropy)
        # Through the (wrapped) model's own call: DDP's and FSDP's hooks fire as usual.
        out = model(input_ids=ids, head_loss=self._heads[key], head_targets=labels, **rest)
        shape = (*labels.shape, 2) if with_entropy else tuple(labels.shape)
        if not (isinstance(out, torch.Tensor) and tuple(out.shape) == shape):
            raise TaskOutputError(
                f"{self.task}: {type(unwrap(model)).__name__} declares output_head(), so its "
                "forward(..., head_loss=fn, head_targets=targets) must return fn's value, "
                f"here of shape {shape}; it returned "
                f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
                ". See engine/numerics/chunked_ce.py's OutputHead"
            )
        if with_entropy:
            return TokenScores(out[..., 0], out[..., 1].detach())
        return TokenScores(out)


class CausalLMTask:
    """Next-token prediction, exact over padding.

    A tuple batch `(inputs, targets)` is already aligned: the logits at position t predict
    `targets[:, t]` (nanoGPT's layout). A dict batch holds `input_ids` (and anything else the
    model takes, e.g. `attention_mask`) and optionally `labels`; without `labels` the targets
    are `input_ids`, with positions where `attention_mask` is 0 ignored. Dict targets are
    shifted here: the logits at t predict `labels[:, t + 1]`, so the loss items are the
    non-ignored `labels[:, 1:]` (one fewer per row than the labels). A dict with `shift_labels`
    (transformers' name) holds targets aligned with the positions already: `shift_labels[:, t]`
    is what position t predicts (so a sequence split over ranks keeps its targets, dist.cp).

    A model that declares `OutputHead` (engine/numerics/chunked_ce.py) computes the loss inside
    its own forward (`head_loss=`), so a compiled model's graph holds the loss too. When its
    output layer has at least `chunked_vocab_threshold` classes, the loss is computed
    `chunk_size` tokens at a time (the same sum, never the logits of the whole micro-batch);
    `chunk_size="auto"` picks the chunk from the vocabulary and the device's memory
    (`auto_chunk_size`), `chunk_size=None` always uses the plain logits.
    """

    name = "task=causal_lm"
    unit = "tokens"  # what a loss item is: the progress line's throughput unit

    def __init__(
        self,
        chunk_size: ChunkSize = "auto",
        chunked_vocab_threshold: int = 32768,
    ) -> None:
        check_chunking(chunk_size, chunked_vocab_threshold)
        self.chunk_size = chunk_size
        self.chunked_vocab_threshold = chunked_vocab_threshold
        # One object per vocabulary and device for the whole run: torch.compile guards on the
        # head loss, so it must not change from step to step.
        self.plain_head_loss = PlainCrossEntropy()
        self._chunked: dict[tuple[int, torch.device], ChunkedCrossEntropy] = {}

    def chunked(self, model: nn.Module) -> bool:
        """Whether `model` (maybe DDP-, FSDP- or compile-wrapped) gets the chunked loss."""
        return chunked_head(model, self.chunk_size, self.chunked_vocab_threshold) is not None

    def head_loss(self, model: nn.Module) -> HeadLoss | None:
        """The loss `model`'s forward computes (`head_loss=`): chunked or plain for a model
        that declares `OutputHead`, None (the task reads the logits) for any other."""
        inner = unwrap(model)
        if not isinstance(inner, OutputHead):
            return None
        if not self.chunked(model):
            return self.plain_head_loss
        head = inner.output_head()
        key = (head.out_features, head.weight.device)
        if key not in self._chunked:
            chunk = tokens_per_chunk(self.chunk_size, head.out_features, head.weight.device)
            self._chunked[key] = ChunkedCrossEntropy(chunk)
        return self._chunked[key]

    def _targets(self, batch: Any) -> tuple[Any, torch.Tensor, bool, bool]:
        """(model inputs, targets, inputs are keyword arguments, the targets are shifted:
        position t predicts target t, one position fewer than the inputs)."""
        if isinstance(batch, Mapping) and "shift_labels" in batch:  # aligned already
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
            return inputs, batch["shift_labels"], True, False
        if isinstance(batch, Mapping) and "labels" not in batch:
            if "input_ids" not in batch:
                raise TaskOutputError(
                    f"{self.name}: a dict batch needs `input_ids` (and optionally `labels`); it "
                    f"has {sorted(batch)}"
                )
            labels = batch["input_ids"]
            mask = batch.get("attention_mask")
            if mask is not None:
                labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
            return dict(batch), labels[:, 1:], True, True
        inputs, targets, as_kwargs = _split(batch, self.name)
        return inputs, (targets[:, 1:] if as_kwargs else targets), as_kwargs, as_kwargs

    def count_items(self, batch: Any) -> torch.Tensor:
        targets = self._targets(batch)[1]
        return (targets != IGNORE_INDEX).sum()

    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets, as_kwargs, shifted = self._targets(batch)
        head_loss = self.head_loss(model)
        if head_loss is not None:
            return self._loss_in_forward(model, head_loss, inputs, targets, as_kwargs, shifted)
        logits = logits_of(_forward(model, inputs, as_kwargs), self.name)  # (B, T, V)
        if shifted:
            logits = logits[:, :-1]  # (B, T-1, V): position t predicts token t+1
        _check_shapes(logits, targets, self.name, "the targets")
        return F.cross_entropy(
            _float_logits(logits).flatten(0, 1),
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def _loss_in_forward(
        self,
        model: nn.Module,
        head_loss: HeadLoss,
        inputs: Any,
        targets: torch.Tensor,
        as_kwargs: bool,
        shifted: bool,
    ) -> torch.Tensor:
        if shifted:  # (B, T): the last position predicts nothing
            targets = F.pad(targets, (0, 1), value=IGNORE_INDEX)
        # Through the (wrapped) model's own call: DDP's and FSDP's hooks fire as for logits.
        loss_kwargs = {"head_loss": head_loss, "head_targets": targets}
        extra = {**inputs, **loss_kwargs} if as_kwargs else loss_kwargs
        loss = model(**extra) if as_kwargs else model(inputs, **extra)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise TaskOutputError(
                f"{self.name}: {type(unwrap(model)).__name__} declares output_head(), so its "
                "forward(..., head_loss=fn, head_targets=targets) must return fn's scalar loss; "
                f"it returned a {type(loss).__name__}. See engine/numerics/chunked_ce.py's "
                "OutputHead"
            )
        return loss


class ClassificationTask:
    """One label per sample: cross-entropy summed over samples whose label is not -100.

    Evaluation also sums correct predictions, reported as `val/accuracy` (correct / items,
    over all ranks).
    """

    name = "task=classification"
    unit = "samples"

    def count_items(self, batch: Any) -> torch.Tensor:
        _, labels, _ = _split(batch, self.name)
        return (labels != IGNORE_INDEX).sum()

    def _logits(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels, as_kwargs = _split(batch, self.name)
        logits = logits_of(_forward(model, inputs, as_kwargs), self.name)  # (B, C)
        _check_shapes(logits, labels, self.name, "the labels")
        # (N, C) and (N,): also per-position labels (B, T) with logits (B, T, C).
        return _float_logits(logits).flatten(0, -2), labels.flatten()

    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        logits, labels = self._logits(model, batch)
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        logits, labels = self._logits(model, batch)
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        correct = ((logits.argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()
        return {"loss": loss, "accuracy": correct}


class TokenClassificationTask:
    """One label per position (tagging): cross-entropy summed over positions whose label is not
    `ignore_index`, which are the loss items; evaluation also reports `val/accuracy` over them.

    Batches are `(inputs, labels)` or dicts with `labels` (the model gets the other keys), with
    labels of shape (B, T) and logits (B, T, classes). Pad labels with `ignore_index`
    (`trainer.data.pad_collate(pad={"labels": -100})`): padding is then no loss item.
    """

    name = "task=token_classification"
    unit = "tokens"

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def _labels(self, batch: Any) -> tuple[Any, torch.Tensor, bool]:
        inputs, labels, as_kwargs = _split(batch, self.name)
        if labels.dim() < 2:
            raise TaskOutputError(
                f"{self.name}: labels must hold one label per position, shape (batch, positions); "
                f"got shape {tuple(labels.shape)}. For one label per sample select "
                "task=classification"
            )
        return inputs, labels, as_kwargs

    def count_items(self, batch: Any) -> torch.Tensor:
        _, labels, _ = self._labels(batch)
        return (labels != self.ignore_index).sum()

    def _logits(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels, as_kwargs = self._labels(batch)
        logits = logits_of(_forward(model, inputs, as_kwargs), self.name)  # (B, T, C)
        _check_shapes(logits, labels, self.name, "the labels")
        return _float_logits(logits).flatten(0, -2), labels.flatten()  # (B*T, C), (B*T,)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, ignore_index=self.ignore_index, reduction="sum")

    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self._loss(*self._logits(model, batch))

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        logits, labels = self._logits(model, batch)
        correct = ((logits.argmax(-1) == labels) & (labels != self.ignore_index)).sum()
        return {"loss": self._loss(logits, labels), "accuracy": correct}
