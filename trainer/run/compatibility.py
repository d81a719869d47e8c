"""Which features and layouts refuse each other: one table (`ROWS`), every refusal one row,
its key and its paragraph written once, here.

A feature is a named question about the run's choices (`Feature`), answered True, False, or
None while what decides it is not built yet (a user's model may turn out a mixture of
experts; a task's class is known once it is built). The trainer asks the table at each moment
of a run where more is known (`refuse_incompatible`): the config with its step and callbacks
(trainer/run/lifecycle.py, before the world's size or any process group), then in the
assembly the config again (evaluation, export and the planner start there), the data, the
model and the task once built, and the step once chosen. A row refuses as soon as both of its
features are True, so a row the config decides is refused from the config, in one process,
before anything is built; a row that needs a built part is refused the moment that part is
built. The first row that applies is raised, naming its key.

The engine keeps its own refusals for users who drive it from plain Python (a parallelism's
`check`, engine/parallel/); in a run the table's come first. What composes has no row: DPO
on a mixture of experts trains with the balancing of the policy's own routing (its
reference's forward is not counted: engine/moe/routing.py's `routing_not_counted`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainer.config.errors import ConfigError
from trainer.config.schema import CUDA_GRAPH_MODES, Config
from trainer.tracking.plurals import counted

DPO_TASK = "engine.preference.DPOTask"
PAIRS_DATA = "trainer.data.preference.preference_data"
GRPO_TASK = "trainer.rollout.task.GRPORunTask"
PROMPTS_DATA = "trainer.data.prompts.prompts_data"
ACCUMULATE_STEP = "engine.steps.accumulate.AccumulateStep"
HF_CAUSAL_LM = "trainer.models.hf.causal_lm"
# transformers' mixture families (model=hf_qwen3_moe, hf_mixtral; a pretrained directory's
# config.json `model_type`): known to have routers before the model is built.
MIXTURE_FAMILIES = ("qwen3_moe", "mixtral")
EXPERT_COUNTS = ("num_experts", "num_local_experts")  # a transformers config's expert count


@dataclass(frozen=True)
class Choices:
    """What a run has decided at one moment: the degrees of its layout (`tp`, `pp`, `cp`,
    `ep`), the config (None: the layout alone), and what is built so far (None: not yet).
    `training`: python -m trainer.train (CUDA graphs are captured in training only);
    `pads_batches`: the built data pads each micro-batch to its longest row."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    cfg: Config | None = None
    training: bool = False
    step: Any = None  # the step strategy object
    callbacks: Any = None  # the run's CallbackList
    pads_batches: bool | None = None
    data_description: str = ""
    model: Any = None
    task: Any = None  # the run's own task (not the balancing's wrapper)

    @classmethod
    def of(cls, cfg: Config, dims: Any = None, **built: Any) -> Choices:
        """The choices of `cfg` laid out by `dims` (a ParallelDims or DistCfg: their degrees;
        default `cfg.dist`), with what is `built`."""
        dims = dims if dims is not None else cfg.dist
        return cls(dims.tp, dims.pp, dims.cp, dims.ep, cfg, **built)

    def knowing(self, **built: Any) -> Choices:
        """These choices with more of the run built."""
        return replace(self, **built)

    def checked(self) -> Choices:
        """These choices, once the table refuses none of them (`refuse_incompatible`)."""
        refuse_incompatible(self)
        return self


@dataclass(frozen=True)
class Feature:
    """A named question about the run's choices: `test(choices)` answers True, False or None
    (not decided yet at this moment); `decided`: from what it is known, for the docs
    (`config`: the config alone, its step and callbacks built; `data`, `model`, `task`: that
    part once built; `config or model`: the config when it says, else the part once built)."""

    name: str
    test: Callable[[Choices], bool | None]
    decided: str = "config"

    def __call__(self, c: Choices) -> bool | None:
        return self.test(c)


def of_config(name: str, test: Callable[[Config], bool]) -> Feature:
    """A feature of the config alone (None for the layout alone)."""
    return Feature(name, lambda c: None if c.cfg is None else bool(test(c.cfg)))


def of_step(name: str, test: Callable[[Any], bool]) -> Feature:
    """A feature of the step strategy, known once it is built from the config."""
    return Feature(name, lambda c: None if c.step is None else bool(test(c.step)))


def negated(feature: Feature, name: str) -> Feature:
    def test(c: Choices) -> bool | None:
        answer = feature(c)
        return None if answer is None else not answer

    return Feature(name, test, feature.decided)


def both(first: Feature, second: Feature, name: str) -> Feature:
    """True when both are; False when either is False (None otherwise)."""

    def test(c: Choices) -> bool | None:
        a, b = first(c), second(c)
        return False if a is False or b is False else (None if a is None or b is None else True)

    return Feature(name, test, first.decided)


# ---- the features ------------------------------------------------------------------------


def _accumulate(step: Any) -> bool:
    from engine.steps.accumulate import AccumulateStep

    return isinstance(step, AccumulateStep)


def _plain_accumulation(step: Any) -> bool:
    from engine.steps.accumulate import AccumulateStep

    return type(step) is AccumulateStep


def _cached(step: Any) -> bool:
    from engine.steps.cached import CachedStep

    return isinstance(step, CachedStep)


def _dp_sgd(step: Any) -> bool:
    from engine.steps.dp_sgd import DPSGDStep

    return isinstance(step, DPSGDStep)


def _dpo(c: Choices) -> bool | None:
    if c.task is not None:
        from engine.preference import DPOTask

        return isinstance(c.task, DPOTask)
    if c.cfg is None:
        return None
    return True if c.cfg.task.get("_target_") == DPO_TASK else None  # (a subclass: once built)


def _grpo(c: Choices) -> bool | None:
    if c.task is not None:
        from trainer.rollout.task import GRPORunTask

        return isinstance(c.task, GRPORunTask)
    if c.cfg is None:
        return None
    return True if c.cfg.task.get("_target_") == GRPO_TASK else None  # (a subclass: once built)


def _window_task(c: Choices) -> bool | None:
    if c.task is None:
        return None
    from engine.window_task import WindowTask

    return isinstance(c.task, WindowTask)


def mixture_in_config(node: Any) -> bool | None:
    """Whether a `model` node builds a mixture of experts, as far as the config says: the
    in-tree GPT's `model.moe.experts`, the expert count of a transformers model built from
    `model.config` (`num_experts`, `num_local_experts`), transformers' mixture families
    (`family`), or a pretrained directory's config.json; None for any other model (known
    once it is built)."""
    moe = node.get("moe")
    if isinstance(moe, Mapping):
        return int(moe.get("experts", 0) or 0) > 0
    if node.get("_target_") != HF_CAUSAL_LM:
        return None
    fields = node.get("config")
    pretrained = node.get("pretrained")
    if pretrained:
        config = Path(str(pretrained)).expanduser() / "config.json"
        try:
            fields = json.loads(config.read_text())
        except (OSError, ValueError):
            return None  # the model's own loading names what is wrong with the directory
    fields = fields if isinstance(fields, Mapping) else {}
    counts = any(fields.get(name) for name in EXPERT_COUNTS)
    family = fields.get("model_type", node.get("family"))
    return counts or family in MIXTURE_FAMILIES


def _routers(model: Any) -> int:
    from engine.moe.routing import HasRouters

    return len(list(model.routers())) if isinstance(model, HasRouters) else 0


def _mixture(c: Choices) -> bool | None:
    if c.model is not None:
        return _routers(c.model) > 0
    return None if c.cfg is None else mixture_in_config(c.cfg.model)


def _balance_needs(cfg: Config) -> bool:
    from engine.moe.strategies import strategy

    return bool(strategy(cfg.moe.balance).needs)


def _averaged(c: Choices) -> bool | None:
    return None if c.callbacks is None else bool(c.callbacks.averaged_weights())


def _whole_model_callback(c: Choices) -> bool | None:
    return None if c.callbacks is None else bool(_whole_model_callbacks(c.callbacks))


def _per_micro(c: Choices) -> bool | None:
    if c.callbacks is None:
        return None
    return any(cb.per_micro_batch for cb in c.callbacks.named.values())


def _whole_model_callbacks(callbacks: Any) -> list[str]:
    averaged = callbacks.averaged_weights()
    return [n for n, cb in callbacks.named.items() if cb.per_micro_batch or n in averaged]


TP = Feature("dist.tp > 1", lambda c: c.tp > 1)
PP = Feature("dist.pp > 1", lambda c: c.pp > 1)
CP = Feature("dist.cp > 1", lambda c: c.cp > 1)
EP = Feature("dist.ep > 1", lambda c: c.ep > 1)
DPO = Feature("task=dpo", _dpo, "config or task")
ADAPTER = of_config("adapter=lora", lambda cfg: cfg.adapter.kind != "none")
FP8 = of_config("train.precision=fp8", lambda cfg: cfg.train.precision == "fp8")
SCALED_OR_FLOAT8 = of_config(
    "train.precision=fp16|fp8", lambda cfg: cfg.train.precision in ("fp16", "fp8")
)
POISSON = of_config("data.sampling=poisson", lambda cfg: cfg.data.get("sampling") == "poisson")
AUTO_MICRO = of_config(
    "train.micro_batch_size=auto", lambda cfg: cfg.train.micro_batch_size == "auto"
)
COMPILE = of_config("train.compile=true", lambda cfg: bool(cfg.train.compile))
PER_LAYER_NORMS = of_config(
    "train.grad_norms=per_layer", lambda cfg: cfg.train.grad_norms == "per_layer"
)
UNPACKED = of_config("data.packed=false", lambda cfg: cfg.data.get("packed") is False)
PAIRS = of_config("data=preference", lambda cfg: cfg.data.get("_target_") == PAIRS_DATA)
GRPO = Feature("task=grpo", _grpo, "config or task")
NOT_GRPO = negated(
    Feature("task=grpo", lambda c: None if c.task is None else _grpo(c), "task"), "not task=grpo"
)
PROMPTS = of_config("data=prompts", lambda cfg: cfg.data.get("_target_") == PROMPTS_DATA)
NOT_PROMPTS = negated(PROMPTS, "not data=prompts")
CONFIGURED_STEP = of_config(
    "a step other than step=accumulate", lambda cfg: cfg.step.get("_target_") != ACCUMULATE_STEP
)
CUDA_GRAPHS = Feature(
    "CUDA graphs (train.compile_mode=reduce-overhead|max-autotune)",
    lambda c: (
        None if c.cfg is None else c.training and c.cfg.train.compile_mode in CUDA_GRAPH_MODES
    ),
    "config (training)",
)
MOE = Feature(
    "a mixture of experts",
    _mixture,
    "config or model",
)
ROUTED = Feature(
    "a model with routers",
    lambda c: None if c.model is None else _routers(c.model) > 0,
    "model",
)
BALANCE_BEFORE_BACKWARD = both(
    MOE, of_config("moe.balance=global|seq_aux", _balance_needs), "moe.balance=global|seq_aux"
)
SEQ_AUX = both(
    MOE,
    of_config("moe.balance=seq_aux", lambda cfg: cfg.moe.balance == "seq_aux"),
    "moe.balance=seq_aux",
)
PADS_BATCHES = Feature(
    "data padded to each micro-batch's longest row",
    lambda c: c.pads_batches,
    "data",
)
WINDOW_TASK = Feature("a loss of the whole window", _window_task, "task")
PER_MICRO_TASK = negated(WINDOW_TASK, "a loss per micro-batch")
NOT_DPO = negated(
    Feature("task=dpo", lambda c: None if c.task is None else _dpo(c), "task"), "not task=dpo"
)
DP_SGD = of_step("step=dp_sgd", _dp_sgd)
NOT_DP_SGD = negated(DP_SGD, "any step but step=dp_sgd")
NOT_PLAIN = of_step(
    "a step other than step=accumulate's window", lambda s: not _plain_accumulation(s)
)
UNPREPARED = of_step("a step that prepares no window", lambda s: not _accumulate(s))
CACHED = of_step("step=cached", _cached)
PER_MICRO_STEP = of_step(
    "a step of one micro-batch at a time", lambda s: not _plain_accumulation(s) and not _cached(s)
)
AVERAGED = Feature("an averaged copy of the weights (callbacks: EMA)", _averaged, "config")
WHOLE_MODEL_CALLBACK = Feature(
    "a callback of every micro-batch's gradient or of every weight",
    _whole_model_callback,
    "config",
)
PER_MICRO_CALLBACK = Feature("a callback of every micro-batch's gradient", _per_micro, "config")
FT = of_config("ft=torchft", lambda cfg: cfg.ft.enabled)


# ---- the values a paragraph names ----------------------------------------------------------


class Values(dict):
    """What a row's key and paragraph name, computed when a paragraph asks for it."""

    def __init__(self, c: Choices) -> None:
        super().__init__()
        self.c = c

    def __missing__(self, name: str) -> Any:
        c, cfg = self.c, self.c.cfg
        assert cfg is not None or name in ("tp", "pp", "cp", "ep"), name
        getters: dict[str, Callable[[], Any]] = {
            "tp": lambda: c.tp,
            "pp": lambda: c.pp,
            "cp": lambda: c.cp,
            "ep": lambda: c.ep,
            "precision": lambda: cfg.train.precision,
            "step": lambda: type(c.step).__name__,
            "balance": lambda: cfg.moe.balance,
            "needs": lambda: _strategy_needs(cfg),
            "ema": lambda: next(iter(c.callbacks.averaged_weights())),
            "whole_model_callback": lambda: _whole_model_callbacks(c.callbacks)[0],
            "per_micro": lambda: next(
                n for n, cb in c.callbacks.named.items() if cb.per_micro_batch
            ),
            "graphs": lambda: f"train.compile_mode={cfg.train.compile_mode} captures CUDA graphs",
            "data": lambda: c.data_description or "this data",
            "model": lambda: type(c.model).__name__,
            "routers": lambda: counted(_routers(c.model), "router"),
            "moe_key": lambda: (
                "model.moe.experts" if isinstance(cfg.model.get("moe"), Mapping) else "model"
            ),
            "task": lambda: f"task `{cfg.task.get('_target_')}`",
            "task_class": lambda: type(c.task).__name__,
            "cached_needs": lambda: _cached_needs(f"task `{cfg.task.get('_target_')}`"),
            "others": lambda: _other_precisions(),
            "loss_types": lambda: _loss_types(),
            "data_target": lambda: cfg.data.get("_target_"),
            "step_target": lambda: cfg.step.get("_target_"),
        }
        value = getters[name]()
        self[name] = value
        return value


def _strategy_needs(cfg: Config) -> str:
    from engine.moe.strategies import strategy

    return strategy(cfg.moe.balance).needs


def _cached_needs(task_name: str) -> str:
    from engine.window_task import needs_window_task

    return needs_window_task(task_name)


def _loss_types() -> str:
    from engine.preference_losses import LOSS_TYPES

    return "|".join(LOSS_TYPES)


def _other_precisions() -> str:
    from engine.numerics import PRECISIONS

    return ", ".join(p for p in PRECISIONS if p != "fp8")


# ---- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """`first` refuses `second` (both True): `key` and `why` are str.format templates of the
    run's values (`Values`)."""

    first: Feature
    second: Feature
    key: str
    why: str

    def applies(self, c: Choices) -> bool:
        return self.first(c) is True and self.second(c) is True

    def error(self, c: Choices) -> ConfigError:
        values = Values(c)
        return ConfigError(self.key.format_map(values), self.why.format_map(values))


def _splits(layout: Feature, key: str) -> list[Refusal]:
    """What a layout that splits the model (tensor or pipeline parallelism) or its experts
    over ranks cannot run with yet: the same choices, refused in its own words."""
    name = f"dist.{key}"
    return [
        Refusal(
            layout,
            AUTO_MICRO,
            "train.micro_batch_size",
            f"not available with {name}: the automatic micro-batch is not probed with it yet",
        ),
        Refusal(
            layout,
            COMPILE,
            "train.compile",
            f"not available with {name}: compiling it is not built yet",
        ),
        Refusal(
            layout,
            PER_LAYER_NORMS,
            "train.grad_norms",
            f"not available with {name}: per-layer norms would be recorded for this rank's share "
            "of the model only",
        ),
        Refusal(
            layout,
            NOT_PLAIN,
            "step",
            f"with {name} the window runs as step=accumulate's; {{step}} needs the whole model "
            "on one rank",
        ),
        Refusal(
            layout,
            WHOLE_MODEL_CALLBACK,
            "callbacks.{whole_model_callback}",
            f"not available with {name}: it looks at every micro-batch's gradients or keeps a "
            "copy of every weight, which no rank holds whole",
        ),
    ]


GRAPHS_INSTEAD = (
    "shapes that do not vary (packed token data, data.sampling=shuffle, a fixed micro-batch)"
)
GRAPHS_END = ", or train.compile_mode=null or max-autotune-no-cudagraphs"
DENSE = "Use dist.strategy=ddp or fsdp"


GRAPHS_PREFIX = "{graphs}, which need the same shapes every step; "


def _graphs(second: Feature, key: str, why: str, instead: str = GRAPHS_INSTEAD) -> Refusal:
    return Refusal(CUDA_GRAPHS, second, key, f"{GRAPHS_PREFIX}{why}. Use {instead}{GRAPHS_END}")


def _fault_tolerance() -> list[Refusal]:
    """What replica groups (ft=torchft) do not compose with yet: rank r of a group sums its
    gradients with rank r of every other group, and a step redone by fewer groups is dealt by
    micro-batch, so each group holds the model whole or as FSDP2's shards and runs the plain
    window; the sums a feature makes over one group's ranks would miss the others'."""
    return [
        *(
            Refusal(
                FT,
                split,
                f"dist.{key}",
                f"must be 1 under ft=torchft (got {{{key}}}): a replica group holds the whole "
                "model (dist.strategy=ddp) or FSDP2's shards of it (fsdp), and its rank r sums "
                "with rank r of every other group; a group split by tensor, pipeline, context "
                "or expert parallelism is not built yet",
            )
            for key, split in (("tp", TP), ("pp", PP), ("cp", CP), ("ep", EP))
        ),
        Refusal(
            FT,
            AUTO_MICRO,
            "train.micro_batch_size",
            "auto is not available under ft=torchft: every replica group must run the same "
            "micro-batches (a redone step is dealt over the live groups by micro-batch); set a "
            "number",
        ),
        Refusal(
            FT,
            NOT_PLAIN,
            "step",
            "under ft=torchft the step is step=accumulate's window, whose sums span the replica "
            "groups; {step} reduces over the ranks of one group",
        ),
        Refusal(
            FT,
            PER_MICRO_CALLBACK,
            "callbacks.{per_micro}",
            "not available under ft=torchft: it looks at every micro-batch of this group only, "
            "and a step redone by fewer groups would count its micro-batches twice",
        ),
    ]


ROWS: tuple[Refusal, ...] = (
    # ---- replica groups (ft=torchft): each group the plain window over whole or FSDP2 models
    *_fault_tolerance(),
    # ---- expert parallelism: carved from the data-parallel ranks, its experts split
    *(
        Refusal(
            EP,
            split,
            "dist.ep",
            f"does not compose with dist.{key}={{{key}}} yet (expert parallelism is carved from "
            f"the data-parallel ranks of DDP or FSDP2); set dist.ep=1 or dist.{key}=1",
        )
        for key, split in (("tp", TP), ("pp", PP), ("cp", CP))
    ),
    Refusal(
        EP,
        AVERAGED,
        "callbacks.{ema}",
        "not available with dist.ep > 1 yet: it keeps an average of every weight, and each rank "
        "holds only its own experts; remove callbacks.{ema} or set dist.ep=1",
    ),
    Refusal(
        EP,
        AUTO_MICRO,
        "train.micro_batch_size",
        "not available with dist.ep > 1: auto is not probed with it yet; set a number (e.g. "
        "train.micro_batch_size=4), or dist.ep=1",
    ),
    Refusal(
        EP,
        COMPILE,
        "train.compile",
        "not available with dist.ep > 1: compiling the all-to-all is not built yet; set "
        "train.compile=false, or dist.ep=1",
    ),
    Refusal(
        EP,
        PER_LAYER_NORMS,
        "train.grad_norms",
        "not available with dist.ep > 1: per-layer norms would see this rank's experts only; "
        "set train.grad_norms=total, or dist.ep=1",
    ),
    Refusal(
        EP,
        NOT_PLAIN,
        "step",
        "not available with dist.ep > 1: {step} is not built with it yet; use step=accumulate, "
        "or dist.ep=1",
    ),
    # ---- tensor and pipeline parallelism: the model split over ranks
    *_splits(TP, "tp"),
    *_splits(PP, "pp"),
    # ---- context parallelism: each sequence split over ranks
    Refusal(
        CP,
        NOT_PLAIN,
        "step",
        "with dist.cp the window's sequences are split over ranks as step=accumulate splits "
        "them; {step} would see them whole",
    ),
    Refusal(
        CP,
        AUTO_MICRO,
        "train.micro_batch_size",
        "auto is not probed with dist.cp yet; set a number",
    ),
    # ---- preference tuning: a pair's sequences whole on one rank
    *(
        Refusal(
            DPO,
            split,
            f"dist.{key}",
            f"task=dpo is not available with dist.{key}={{{key}}}: a pair's loss needs the summed "
            "log-probabilities of both its sequences, each whole on one rank, and splitting "
            "sequences over ranks (cp) or the model into stages (pp) is not built for pairs. "
            + DENSE,
        )
        for key, split in (("cp", CP), ("pp", PP))
    ),
    Refusal(
        DPO,
        EP,
        "dist.ep",
        "task=dpo with dist.ep > 1 is not built yet: the reference would need its experts split "
        "over the ranks as the policy's are (a frozen copy holds every expert). task=dpo trains "
        "a mixture of experts under DDP or FSDP2: set dist.ep=1",
    ),
    Refusal(
        DPO,
        SEQ_AUX,
        "moe.balance",
        "seq_aux balances each row of a (B, T) batch as a sequence, and task=dpo's rows are "
        "the two sides of a pair (pairs, 2, T), or a pair's two documents packed in one row. "
        "Use moe.balance=global (the policy's routing of the whole step, exact), micro, bias "
        "or none",
    ),
    Refusal(
        PAIRS,
        NOT_DPO,
        "task",
        "data=preference gives pairs of a chosen and a rejected answer, which train with "
        "task=dpo (task.loss_type={loss_types}); {task_class} reads other batches. Select "
        "task=dpo, or data=chat to fine-tune on the conversations",
    ),
    # ---- reinforcement learning: rollouts generated by the whole policy on each rank
    Refusal(
        PROMPTS,
        NOT_GRPO,
        "task",
        "data=prompts gives prompts without answers to learn from: the policy generates the "
        "completions and reward functions score them, which trains with task=grpo "
        "(reward=[exact_answer], rollout.*); {task_class} reads other batches. Select "
        "task=grpo, or data=chat to fine-tune on written answers",
    ),
    Refusal(
        GRPO,
        NOT_PROMPTS,
        "data",
        "task=grpo generates completions for prompts and learns from their rewards: it needs "
        "data=prompts (data.path= rows of a `prompt` and the fields the rewards read, e.g. "
        "`answer`), not data `{data_target}`",
    ),
    *(
        Refusal(
            GRPO,
            split,
            f"dist.{key}",
            f"task=grpo is not available with dist.{key}={{{key}}}: the policy generates each "
            "prompt's completions token by token, with the whole model and whole sequences on "
            f"each rank, and {why} is not built for generation. " + DENSE,
        )
        for key, split, why in (
            ("pp", PP, "splitting the model into pipeline stages"),
            ("tp", TP, "splitting its layers over ranks"),
            ("cp", CP, "splitting sequences over ranks"),
        )
    ),
    Refusal(
        GRPO,
        AUTO_MICRO,
        "train.micro_batch_size",
        "auto is not available with task=grpo: the micro-batches are of completions, made "
        "after generation (rollout.micro_batch_size); set train.micro_batch_size to a number "
        "of prompts",
    ),
    Refusal(
        GRPO,
        CONFIGURED_STEP,
        "step",
        "task=grpo trains its rollouts with step=accumulate (the step's denominator counted "
        "over the whole global batch before any backward); `{step_target}` is not built with "
        "it yet",
    ),
    # ---- adapters: peft's layers
    Refusal(
        ADAPTER,
        TP,
        "dist.tp",
        "adapter=lora is not available with dist.tp={tp}: peft's own tensor parallelism is "
        "Megatron's (megatron_config), which cumulus's DTensor plans do not use: the plans "
        "would split the frozen base layers inside peft's wrappers and leave lora_A / lora_B "
        "whole on every rank. Adapters train under dist.strategy=ddp or dist.strategy=fsdp "
        "(FSDP2 shards the frozen base as well), which is how a large base fits: use those, or "
        "adapter=none",
    ),
    Refusal(
        ADAPTER,
        PP,
        "dist.pp",
        "adapter=lora is not available with dist.pp={pp}: peft has no pipeline support, and "
        "cumulus's pipeline checkpoints are not built for trainable parameters alone. Adapters "
        "train under dist.strategy=ddp or dist.strategy=fsdp (FSDP2 shards the frozen base as "
        "well), which is how a large base fits: use those, or adapter=none",
    ),
    # ---- CUDA graphs: the same shapes every step
    _graphs(
        UNPACKED, "data.packed", "false pads each micro-batch to its longest sample: lengths vary"
    ),
    _graphs(
        PADS_BATCHES,
        "data",
        "{data} pads each micro-batch to its longest row (packed conversations too): lengths vary",
    ),
    _graphs(POISSON, "data.sampling", "poisson draws a batch of a different size every step"),
    _graphs(AUTO_MICRO, "train.micro_batch_size", "auto probes several micro-batch sizes"),
    _graphs(
        ROUTED,
        "{moe_key}",
        "{model} is a mixture of experts ({routers}), whose dispatch reads each expert's "
        "token count to the host and gives each expert as many rows as were routed to it: shapes "
        "vary every step",
        "a dense model",
    ),
    # ---- precision
    Refusal(
        FP8,
        TP,
        "train.precision",
        "fp8 is not available with dist.tp={tp}: float8 layers need torchao's own "
        "tensor-parallel plans, not built yet; use dist.tp=1, or {others} with dist.tp",
    ),
    Refusal(
        DP_SGD,
        SCALED_OR_FLOAT8,
        "train.precision",
        "step=dp_sgd supports fp32 or bf16, not {precision}: its per-sample gradients "
        "(torch.func's vmap) run neither under fp16's loss scaler nor through fp8's float8 "
        "layers",
    ),
    Refusal(
        DPO,
        DP_SGD,
        "step",
        "task=dpo with step=dp_sgd is not built yet: DP-SGD takes each sample's gradient under "
        "torch.func's vmap, and a pair's log-probabilities (taken a chunk of tokens at a time "
        "by an autograd function of their own) and its reference's forward do not run there. "
        "Train task=dpo with step=accumulate (the default)",
    ),
    Refusal(
        POISSON,
        NOT_DP_SGD,
        "data.sampling",
        "poisson draws variable-size batches for DP-SGD's privacy accounting; it needs "
        "step=dp_sgd (valid otherwise: shuffle)",
    ),
    # ---- mixtures of experts: the balancing counts whole tokens and experts on each rank
    *(
        Refusal(
            MOE,
            split,
            f"dist.{key}",
            f"must be 1 with a mixture-of-experts model (got {{{key}}}): the routers' "
            "load-balancing loss (moe.balance) is counted over whole tokens and whole experts on "
            "each data-parallel rank; tensor, pipeline and context parallelism would split them "
            "and are not built for it yet. " + DENSE,
        )
        for key, split in (("tp", TP), ("pp", PP), ("cp", CP))
    ),
    Refusal(
        BALANCE_BEFORE_BACKWARD,
        UNPREPARED,
        "moe.balance",
        "{balance} {needs}, which step=accumulate does; {step} does not. Use step=accumulate, "
        "or moe.balance=micro|none",
    ),
    Refusal(
        MOE,
        WINDOW_TASK,
        "task",
        "a mixture-of-experts model's load balancing (moe.balance) needs a task with a loss per "
        "micro-batch (task=causal_lm, classification, token_classification); a loss of the "
        "whole window (step=cached) does not combine with it yet",
    ),
    # ---- a loss of the whole window: step=cached's two passes
    Refusal(
        WINDOW_TASK,
        PER_MICRO_STEP,
        "step",
        "the loss of {task} is of the whole window; {step} would see one micro-batch at a time. "
        "Use step=cached (chosen by itself when no step is set)",
    ),
    Refusal(CACHED, PER_MICRO_TASK, "step", "{cached_needs}"),
    Refusal(
        WINDOW_TASK,
        PER_MICRO_CALLBACK,
        "callbacks.{per_micro}",
        "observes every micro-batch's gradient; under step=cached a micro-batch's gradient is "
        "its share of the whole window's loss, not a loss of its own, so its statistics would "
        "not mean what they say. Remove it for this task",
    ),
)


def refused(c: Choices) -> Iterator[Refusal]:
    """The rows that apply to `c`, in the table's order."""
    return (row for row in ROWS if row.applies(c))


def refuse_incompatible(c: Choices) -> None:
    """Raise the first row of the table that applies to `c` (one paragraph naming its key)."""
    row = next(refused(c), None)
    if row is not None:
        raise row.error(c)


def markdown() -> str:
    """The table as docs/architecture.md shows it (tests/test_compatibility.py keeps the two
    alike): each row's features, what decides them, its key and the start of its paragraph
    (the values it names in braces)."""
    lines = [
        "| refuses | with | decided by | key | why (the paragraph's start) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in ROWS:
        decided = " / ".join(dict.fromkeys([row.first.decided, row.second.decided]))
        why = re.split(r"; |\. ", row.why.removeprefix(GRAPHS_PREFIX), maxsplit=1)[0]
        cells = [row.first.name, row.second.name, decided, f"`{row.key}`", why]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
