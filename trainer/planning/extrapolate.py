"""A few blocks per stage simulated, the rest extrapolated: the decoder blocks of a stage are
identical, so each one adds the same bytes.

A Llama-3-8B stage of 8 blocks takes minutes to simulate; one of 2 or 3 blocks a fraction.
Every figure of a role (its peak and each category at the peak, its own parameter,
gradient and optimizer bytes, each collective's bytes) is the same function of the blocks a
stage holds: what the stage holds besides its blocks (embeddings, the output layer, the
loss's temporaries, a pipeline's in-flight inputs) plus the blocks times what each adds
(their parameters and states, the activations each keeps for backward, the gathers and
reductions of each). The planner simulates the model with `SAMPLES[0]` and `SAMPLES[1]`
blocks per stage and takes each figure on the line through the two, at the stage's real
count; tests/test_plan.py checks it against the full simulation (1%). The peak is the highest
of the step's moments, each on its line; a part of the step outside the blocks whose ops
depend on the block count (a mixture's balancing loss over every layer's router logits) is
one moment, its highest point (`aligned`).

It applies when the model's block count is a config key (`LAYER_KEYS`, at the model's node or
its transformers `config`), the blocks are alike (one class, the same parameter shapes),
every pipeline stage holds the same number of them (no `dist.pp_split`) and that number is
larger than `SAMPLES[1]`; otherwise, and with `plan.full=true`, every block is simulated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from engine.parallel.dims import ParallelDims
from trainer.config.schema import Config
from trainer.run.memory import MemoryReport

LAYER_KEYS = ("n_layer", "num_hidden_layers", "n_layers", "num_layers")
SAMPLES = (2, 3)  # blocks per pipeline stage simulated; the line through them gives the rest


@dataclass(frozen=True)
class Shortcut:
    """Where the model's block count sits in `cfg.model` and how the stages share them."""

    path: tuple[str, ...]
    blocks: int
    stages: int  # pipeline stages (pp x virtual); 1 without a pipeline

    @property
    def per_stage(self) -> int:
        return self.blocks // self.stages

    def sample(self, cfg: Config, per_stage: int) -> Config:
        """`cfg` with `per_stage` blocks in every stage."""
        model = OmegaConf.to_container(OmegaConf.create(cfg.model))
        node: Any = model
        for key in self.path[:-1]:
            node = node[key]
        node[self.path[-1]] = per_stage * self.stages
        return dataclasses.replace(cfg, model=model)


def layer_path(model: Any) -> tuple[tuple[str, ...], int] | None:
    """The key of `cfg.model` (or of its `config`) holding the block count, and its value."""
    for prefix in ((), ("config",)):
        node = model
        for key in prefix:
            node = node.get(key) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            continue
        for key in LAYER_KEYS:
            value = node.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return (*prefix, key), value
    return None


def shortcut(cfg: Config, dims: ParallelDims) -> Shortcut | None:
    """How to simulate `cfg` with fewer blocks, or None where every block must run."""
    found = layer_path(cfg.model)
    if found is None or cfg.dist.pp_split:
        return None
    path, blocks = found
    stages = dims.pp * (dims.pp_virtual if dims.pp > 1 else 1)
    if blocks % stages or blocks // stages <= SAMPLES[-1]:
        return None
    return Shortcut(path, blocks, stages)


def alike(blocks: Sequence[Any]) -> bool:
    """Blocks of one class with the same parameter names, shapes and dtypes."""
    if not blocks:
        return False

    def signature(block: Any) -> tuple[Any, ...]:
        params = tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters())
        return (type(block), params)

    first = signature(blocks[0])
    return all(signature(b) == first for b in blocks[1:])


def line(a: int, b: int, at: int) -> int:
    """The value at `at` blocks of the line through `a` (at SAMPLES[0]) and `b` (SAMPLES[1])."""
    k0, k1 = SAMPLES
    return a + round((b - a) * (at - k0) / (k1 - k0))


def _lines(a: dict[str, int], b: dict[str, int], at: int) -> dict[str, int]:
    return {k: line(a.get(k, 0), b.get(k, 0), at) for k in sorted(a.keys() | b.keys())}


def memory(a: MemoryReport, b: MemoryReport, at: int) -> MemoryReport:
    """A role's memory at `at` blocks per stage: its own bytes on the line through the two
    samples; its peak the highest of the moments' peaks (StepTracker.moment), each on its
    line. The peak itself is not one line: with few blocks a stage's peak can be where it
    holds the least activations (its embedding's backward), with many where it holds the
    most (its first block's backward)."""
    ints = {
        "parameters_bytes": line(a.parameters_bytes, b.parameters_bytes, at),
        "gradients_bytes": line(a.gradients_bytes, b.gradients_bytes, at),
        "optimizer_bytes": line(a.optimizer_bytes, b.optimizer_bytes, at),
        "buffers_bytes": line(a.buffers_bytes, b.buffers_bytes, at),
    }
    untracked = _lines(a.untracked, b.untracked, at)
    # In the step's order (dicts keep it; a set's order follows the string hash seed): of
    # moments that tie on the total, the first is the peak, as a real run's tracker keeps it.
    moments = {k: _lines(*pair, at) for k, pair in aligned(a.moments, b.moments).items()}
    at_peak = max(moments.values(), key=lambda m: m["Total"], default=None)
    if at_peak is None:  # no moments measured: the peak's own line
        at_peak = _lines(a.at_peak, b.at_peak, at)
    return MemoryReport(
        **ints,
        peak_bytes=at_peak.get("Total", 0) + sum(untracked.values()),
        activations_bytes=at_peak.get("ACT", 0),
        temporaries_bytes=at_peak.get("TEMP", 0),
        untracked=untracked,
        at_peak=at_peak,
        moments=moments,
    )


Moment = dict[str, int]


def aligned(a: dict[str, Moment], b: dict[str, Moment]) -> dict[str, tuple[Moment, Moment]]:
    """The moments of the two samples that are one moment of the step, paired. A segment
    (the key without its op index) that runs as many ops in both samples pairs op by op. One
    whose ops depend on the block count (outside the blocks, a loss over every layer's
    router logits: moe.balance) pairs no op with its like: its highest point in each sample
    is taken as one moment, on the line with the other's."""
    ops_a, ops_b = _by_segment(a), _by_segment(b)
    pairs: dict[str, tuple[Moment, Moment]] = {}
    for segment, keys in ops_a.items():
        other = ops_b.get(segment)
        if other is None:
            continue
        if len(keys) == len(other):
            pairs.update((k, (a[k], b[k])) for k in keys if k in b)
            continue
        top_a = max((a[k] for k in keys), key=lambda m: m.get("Total", 0))
        top_b = max((b[k] for k in other), key=lambda m: m.get("Total", 0))
        pairs[f"{segment}/highest"] = (top_a, top_b)
    return pairs


def _by_segment(moments: dict[str, Moment]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key in moments:  # in the step's order
        out.setdefault(key.rsplit("/", 1)[0], []).append(key)
    return out


def comm(a: dict[str, int], b: dict[str, int], at: int) -> dict[str, int]:
    return _lines(a, b, at)
