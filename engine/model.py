"""What the trainer may ask of a model beyond `forward`, all optional, with their fallbacks.

- `block_modules()`: the repeated blocks (transformer layers) that FSDP shards one by one and
  activation checkpointing recomputes. Fallbacks: Hugging Face's `_no_split_modules` class
  names; else, where a feature needs blocks, an error that lists the model's repeated
  module classes so the user can name them (`block_classes`).
- `flops_per_token(seq_len)`: forward + backward FLOPs per loss item, for MFU. Fallback:
  6 x the parameters a token goes through (engine/moe/active.py).
- `generate(idx, max_new_tokens, generator=...)`: text samples at evaluation; none without.
- `output_head()`: the output layer, for `task=causal_lm`'s chunked loss over a large
  vocabulary (engine/numerics/chunked_ce.py's `OutputHead`); the plain logits without.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.moe.active import active_parameters


@runtime_checkable
class DeclaresBlocks(Protocol):
    def block_modules(self) -> Sequence[nn.Module]: ...


@runtime_checkable
class DeclaresFlops(Protocol):
    def flops_per_token(self, seq_len: int) -> float: ...


@runtime_checkable
class Generates(Protocol):
    def generate(self, idx: Any, max_new_tokens: int, **kwargs: Any) -> Any: ...


@runtime_checkable
class DeclaresVocabulary(Protocol):
    """A model that says how many token ids it embeds (the in-tree GPT, transformers' Llama)."""

    vocab_size: int | None


@runtime_checkable
class DeclaresContext(Protocol):
    """A model that says its longest sequence (None: no limit it knows)."""

    max_seq_len: int | None


class NoBlocks(ValueError):
    """A feature needs the model's blocks and nothing names them."""


def repeated_classes(model: nn.Module) -> list[str]:
    """Class names of modules that occur more than once below the root, most frequent first:
    the candidates for `block_classes`."""
    counts = Counter(type(m).__name__ for m in model.modules() if m is not model)
    leafy = {"Linear", "Dropout", "LayerNorm", "RMSNorm", "Embedding", "ModuleList", "GELU"}
    leafy |= {"ReLU", "SiLU", "Identity", "Sequential", "Conv1d", "Conv2d", "MaxPool2d"}
    return [n for n, c in counts.most_common() if c > 1 and n not in leafy]


def find_blocks(
    model: nn.Module, class_names: Sequence[str] | None = None, key: str = "block_classes"
) -> list[nn.Module]:
    """The model's blocks: modules whose class name is in `class_names` when given, else the
    model's own `block_modules()`, else Hugging Face's `_no_split_modules`; [] if none.

    Raises `NoBlocks` when `class_names` names a class the model does not have.
    """
    if class_names:
        wanted = set(class_names)
        blocks = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
        present = {type(m).__name__ for m in blocks}
        if wanted - present:
            raise NoBlocks(
                f"{key}: the model has no module of class {', '.join(sorted(wanted - present))}; "
                f"its repeated module classes are {', '.join(repeated_classes(model)) or 'none'}"
            )
        return _outermost(blocks)
    if isinstance(model, DeclaresBlocks):
        return list(model.block_modules())
    declared = getattr(model, "_no_split_modules", None)  # Hugging Face transformers
    if declared:
        return find_blocks(model, list(declared), key)
    return []


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """Drop modules nested inside another one of the list (a block within a block)."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def require_blocks(model: nn.Module, blocks: list[nn.Module], feature: str, key: str) -> None:
    if not blocks:
        candidates = repeated_classes(model)
        raise NoBlocks(
            f"{feature} needs the model's blocks (the repeated layers to shard or recompute), and "
            f"{type(model).__name__} does not declare them (no `block_modules()` method or "
            f"`_no_split_modules`). Name their classes with {key}=[ClassName, ...]"
            + (
                f"; this model's repeated module classes: {', '.join(candidates)}"
                if candidates
                else ""
            )
        )


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation, generation: nothing to recompute
        return forward(*args, **kwargs)
    # Non-reentrant: works with kwargs and inputs that need no grad, and restores the RNG
    # state, so dropout masks are recomputed exactly.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: Sequence[nn.Module]) -> None:
    """Recompute each block's forward in backward instead of keeping its activations.

    The blocks' own `forward` is wrapped in place: no wrapper module is inserted, so parameter
    names, state dicts and checkpoints stay exactly as without it.
    """
    for block in blocks:
        if getattr(block.forward, "_cumulus_checkpointed", False):
            continue
        wrapped = functools.partial(_checkpointed, block.forward)
        wrapped._cumulus_checkpointed = True  # type: ignore[attr-defined]
        block.forward = wrapped  # type: ignore[method-assign]


def flops_per_token(model: nn.Module, seq_len: int | None) -> float:
    """Training FLOPs per loss item: the model's own count, else 6 x the parameters a token
    goes through (of a mixture's routed experts its top-k: engine/moe/active.py)."""
    if isinstance(model, DeclaresFlops) and seq_len:
        return float(model.flops_per_token(seq_len))
    return 6.0 * active_parameters(model)  # tied parameters counted once
