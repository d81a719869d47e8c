"""The parts every command builds the same way from a config: the model laid out over the
job's ranks, its task, its data. Training (`trainer.run.build`), evaluation (`trainer.evaluate`),
export (`scripts/export_hf.py`) and planning all call these, so none of them assembles a
model that training would not."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.distributed import DistInfo
from engine.model import (
    DeclaresContext,
    DeclaresVocabulary,
    NoBlocks,
    apply_activation_checkpointing,
    find_blocks,
    flops_per_token,
    require_blocks,
)
from engine.moe.routing import HasRouters
from engine.numerics.float8 import Float8Layers
from engine.parallel.base import LayoutError, Parallelism, RunShape
from engine.parallel.dims import ParallelDims
from engine.rng import seed_everything
from engine.step import Task
from engine.window_task import WindowTask, attach_loss_parameters
from trainer.config.components import check, instantiate
from trainer.config.errors import ConfigError
from trainer.config.schema import (
    CONFIG_DIR,
    CUDA_GRAPH_MODES,
    EXTRAS,
    Config,
    DataExtras,
    ModelExtras,
)
from trainer.data import DataSplits, PadCollate, as_splits
from trainer.data.checks import check_samples
from trainer.data.pairs import PairCollate
from trainer.models.lora import Adapter
from trainer.models.lora import check_layout as check_adapter_layout
from trainer.plurals import counted
from trainer.run.float8 import to_float8
from trainer.run.preference import (
    ReferenceFile,
    attach_reference,
    check_pairs_layout,
    check_pairs_task,
    lay_out_reference,
    precompute_reference,
    reference_file,
)


def split_extras(node: dict[str, Any], group: str) -> tuple[dict[str, Any], Any]:
    """A `model`/`data`/`task` node as (the `_target_`'s spec, the keys the trainer reads)."""
    cls = EXTRAS[group]
    names = {f.name for f in dataclasses.fields(cls)}
    spec = {k: v for k, v in node.items() if k not in names}
    extras = {k: v for k, v in node.items() if k in names}
    target = {"_target_": f"{cls.__module__}.{cls.__qualname__}", **extras}
    return spec, instantiate(target, group)


def options(group: str) -> list[str]:
    """The in-tree config names of a group (`model=gpt_tiny`), for error messages."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def check_config(cfg: Config) -> None:
    """Every component's target imports and its arguments fit its signature (names, types,
    required ones): a one-paragraph error naming the key, before any work starts."""
    for group, node in (("model", cfg.model), ("data", cfg.data)):
        spec, _ = split_extras(node, group)
        check(spec, group, options=options(group))
    task = split_extras(cfg.task, "task")[0] if isinstance(cfg.task, dict) else cfg.task
    check(task, "task", options=options("task"))
    check(cfg.optim, "optim", provided=["params"], options=options("optim"))
    check(cfg.scheduler, "scheduler", ["optimizer", "max_steps"], options("scheduler"))
    check(cfg.step, "step", options=options("step"))
    for name, spec in cfg.callbacks.items():
        check(spec, f"callbacks.{name}")


def build_data(node: dict[str, Any]) -> tuple[DataSplits, DataExtras]:
    spec, extras = split_extras(node, "data")
    splits = as_splits(instantiate(spec, "data"), spec["_target_"])
    return splits, extras


def build_model(node: dict[str, Any], info: DistInfo) -> tuple[nn.Module, ModelExtras]:
    """The user's module (or the in-tree GPT) on this rank's device."""
    spec, extras = split_extras(node, "model")
    model = instantiate(spec, "model")
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model._target_",
            f"{spec['_target_']} returned a {type(model).__name__}; it must return an nn.Module",
        )
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device != info.device for t in tensors):  # (a planner's fake tensors: in place)
        model = model.to(info.device)
    return model, extras


def build_task(node: dict[str, Any]) -> Task:
    # task.check_sum is the trainer's (trainer/run/sum_check.py)
    spec, _ = split_extras(node, "task")
    task = instantiate(spec, "task")
    if not isinstance(task, Task | WindowTask):
        raise ConfigError(
            "task._target_",
            f"{spec['_target_']} built a {type(task).__name__}, which is not a task: it needs "
            "count_items(batch) (loss items, without the model) and loss_sum(model, batch) (the "
            "summed loss), see engine/step.py, or for a loss of the whole window represent(model, "
            "batch) and window_loss(reps, rows), see engine/window_task.py; or select "
            f"task={'|'.join(options('task'))}",
        )
    return task


def build_adapter(
    cfg: Config, model: nn.Module, info: DistInfo, shards: bool, fake: bool = False
) -> Adapter | None:
    """`adapter=lora`: LoRA on `model` through peft, the base frozen (trainer/models/lora.py);
    `fake`: on the planner's fake tensors."""
    if cfg.adapter.kind == "none":
        return None
    from trainer.models.lora import apply_adapter

    node = cfg.model
    base = (
        f"model.pretrained={node['pretrained']}"
        if node.get("pretrained")
        else f"{node.get('_target_')} initialized from seed {cfg.seed}"
    )
    return apply_adapter(
        model, cfg.adapter, base=base, shards=shards, is_main=info.is_main, fake=fake
    )


def check_fits(
    model: nn.Module, data: DataSplits, spec: dict[str, Any], length_key: str = "data.block_size"
) -> None:
    """Token ids and sequence lengths the data declares must fit what the model declares
    (`length_key`: the data's key of its sequence length)."""
    vocab = model.vocab_size if isinstance(model, DeclaresVocabulary) else None
    if isinstance(vocab, int) and data.vocab_size is not None and data.vocab_size > vocab:
        key = "model.vocab_size" if "vocab_size" in spec else "model"
        if isinstance(spec.get("config"), dict) and "vocab_size" in spec["config"]:
            key = "model.config.vocab_size"  # a transformers model's config field
        raise ConfigError(
            key,
            f"the data ({data.description or 'data'}) holds token ids up to "
            f"{data.vocab_size - 1}; the model's vocabulary must be at least {data.vocab_size}, "
            f"got {vocab}",
        )
    longest = model.max_seq_len if isinstance(model, DeclaresContext) else None
    if isinstance(longest, int) and data.seq_len is not None and data.seq_len > longest:
        raise ConfigError(
            length_key,
            f"must be <= the model's longest sequence ({longest}: model.block_size, or a "
            f"transformers model's n_positions / max_position_embeddings), got {data.seq_len}",
        )


STATIC_DATA = (
    "shapes that do not vary (packed token data, data.sampling=shuffle, a fixed micro-batch)"
)


def graphs_refused(cfg: Config, key: str, why: str, instead: str = STATIC_DATA) -> ConfigError:
    """CUDA graphs refused for shapes that vary (`why`), in one paragraph naming `key` and
    what to use `instead` (or another compile mode)."""
    return ConfigError(
        key,
        f"train.compile_mode={cfg.train.compile_mode} captures CUDA graphs, which need the "
        f"same shapes every step; {why}. Use {instead}, or train.compile_mode=null or "
        "max-autotune-no-cudagraphs",
    )


def check_static_shapes(cfg: Config, data: DataSplits) -> None:
    """`train.compile_mode` with CUDA graphs (reduce-overhead, max-autotune) replays graphs
    recorded for fixed shapes: refused where the trainer knows the training batches' shapes
    change from step to step (a new shape records a new graph, each holding its own memory),
    as soon as the data is built (the model's own case: `check_static_routing`). Evaluation's
    batches (eval mode, maybe a short last one) record a few graphs once."""
    if cfg.train.compile_mode not in CUDA_GRAPH_MODES:
        return
    varying = {
        "data.packed": (
            cfg.data.get("packed") is False,
            "false pads each micro-batch to its longest sample: lengths vary",
        ),
        "data": (
            isinstance(data.collate_fn, PadCollate | PairCollate),
            f"{data.description or 'this data'} pads each micro-batch to its longest row "
            "(packed conversations too): lengths vary",
        ),
        "data.sampling": (
            cfg.data.get("sampling") == "poisson",
            "poisson draws a batch of a different size every step",
        ),
        "train.micro_batch_size": (
            cfg.train.micro_batch_size == "auto",
            "auto probes several micro-batch sizes",
        ),
    }
    for key, (bad, why) in varying.items():
        if bad:
            raise graphs_refused(cfg, key, why)


def check_static_routing(cfg: Config, model: nn.Module) -> None:
    """CUDA graphs (`check_static_shapes`) refused for a model with routers (model.moe.experts
    > 0, or a transformers mixture), as soon as it is built: its dispatch reads the number of
    tokens routed to each expert to the host and gives each expert that many rows, so shapes
    change every step."""
    if cfg.train.compile_mode not in CUDA_GRAPH_MODES or not isinstance(model, HasRouters):
        return
    routers = len(list(model.routers()))
    if routers:
        key = "model.moe.experts" if isinstance(cfg.model.get("moe"), dict) else "model"
        why = (
            f"{type(model).__name__} is a mixture of experts ({counted(routers, 'router')}), "
            "whose dispatch "
            "reads each expert's token count to the host and gives each expert as many rows "
            "as were routed to it: shapes vary every step"
        )
        raise graphs_refused(cfg, key, why, "a dense model")


def layout_error(exc: LayoutError) -> ConfigError:
    """An engine refusal of a layout, as the config error naming its key."""
    return ConfigError(exc.key, str(exc))


def build_parallelism(dims: ParallelDims, info: DistInfo) -> Parallelism:
    """The parallelism of `dims` on this job's ranks, the device mesh built once."""
    try:
        return dims.build(info)
    except LayoutError as exc:
        raise layout_error(exc) from None


def check_layout(parallel: Parallelism, shape: RunShape) -> None:
    """The parallelism's refusals of the run's other choices, as config errors."""
    try:
        parallel.check(shape)
    except LayoutError as exc:
        raise layout_error(exc) from None


def parameter_dtype(precision: str, dims: ParallelDims, info: DistInfo) -> torch.dtype | None:
    """The dtype the laid-out model computes with its parameters in, when not their own: bf16
    under `train.precision=bf16|fp8` where FSDP2 shards them (`dist.strategy=fsdp` on several
    ranks, also beside tp, pp, cp or ep: it casts each unit's parameters for its forward);
    None where the parameters compute as they are, under autocast (one process, DDP, tp or pp
    without FSDP2, ep over DDP). The one owner of the choice: `parallelize` lays out with it,
    and a precomputed reference is keyed by it."""
    sharded = dims.strategy == "fsdp" and info.distributed
    return torch.bfloat16 if precision in ("bf16", "fp8") and sharded else None


def parallelize(
    model: nn.Module,
    extras: ModelExtras,
    parallel: Parallelism,
    *,
    compile: bool = False,
    compile_mode: str | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Activation checkpointing, compilation (`torch.compile`'s `compile_mode`, None for its
    default) and the parallelism (DDP; FSDP2 sharding each block and the root, computing with
    `param_dtype` parameters (`parameter_dtype`); tensor or pipeline splits), in that order.
    The model's own parameter names are kept."""
    try:
        blocks = find_blocks(model, extras.block_classes, key="model.block_classes")
        if extras.activation_checkpointing:
            require_blocks(
                model, blocks, "model.activation_checkpointing=true", "model.block_classes"
            )
            apply_activation_checkpointing(blocks)
        if parallel.per_block:
            require_blocks(model, blocks, f"dist.strategy={parallel.name}", "model.block_classes")
    except NoBlocks as exc:
        message = str(exc).removeprefix("model.block_classes: ")
        raise ConfigError("model.block_classes", message) from None
    if compile:  # in place: parameter names (and checkpoints) stay the same
        for module in blocks if parallel.per_block else [model]:
            module.compile(mode=compile_mode)
    try:
        return parallel.apply(model, blocks, param_dtype=param_dtype)
    except LayoutError as exc:
        raise layout_error(exc) from None


def layout_reference_file(
    cfg: Config,
    task: Task,
    model: nn.Module,
    data: DataSplits,
    dims: ParallelDims,
    info: DistInfo,
    planned: bool = False,
) -> ReferenceFile | None:
    """`task.reference=precomputed`'s file (trainer/run/preference.py) for this run's layout:
    keyed to the initial model, whole here (fp8's conversion keeps the names), the run's
    micro-batch (1 under auto) and precision, the bf16 parameters the layout computes with
    (`parameter_dtype`, as `parallelize` lays out), its tensor-parallel degree and whether
    that is sequence-parallel."""
    micro = cfg.train.micro_batch_size
    return reference_file(
        task,
        model,
        data,
        micro if micro != "auto" else 1,
        precision=cfg.train.precision,
        planned=planned,
        low_precision_parameters=parameter_dtype(cfg.train.precision, dims, info) is not None,
        tensor_parallel=dims.tp,
        sequence_parallel=dims.sequence_parallel,
    )


@dataclass
class Assembly:
    """A model laid out over the job's ranks, with its task and data: what every command
    starts from. `model` is the user's module (pruned to this rank's stages under a pipeline),
    `wrapped` what the step calls."""

    model: nn.Module
    wrapped: nn.Module
    model_extras: ModelExtras
    parallel: Parallelism
    task: Task
    data: DataSplits
    data_extras: DataExtras
    flops_per_token: float
    n_params: int
    adapter: Adapter | None = None  # adapter=lora: peft's adapters on the frozen base
    n_trainable: int | None = None  # parameters that train (all of them without an adapter)
    float8: Float8Layers | None = None  # train.precision=fp8: the layers converted and kept

    def precision(self, mode: str) -> str:
        """`train.precision` in the banner's words (fp8: which layers are float8)."""
        return self.float8.describe() if self.float8 is not None else mode


def assemble(
    cfg: Config,
    info: DistInfo,
    dims: ParallelDims | None = None,
    building: contextlib.AbstractContextManager | None = None,
    simulated: dict[Any, Any] | None = None,
    static_shapes: bool = False,
) -> Assembly:
    """Seed, build the data, model and task, check that they fit, and lay the model out over
    the ranks (`dims`, by default `dist.*`'s in this world). The model is built and laid out
    within `building` (the planner's fake tensors); the mesh and the data never are. With
    `simulated` (trainer.plan), this rank runs alone in a simulated world. `static_shapes`
    (training): CUDA graphs over shapes that vary are refused on the data before any model is
    built (`check_static_shapes`), and on the model before it is converted, compiled, laid out
    or scores a reference (`check_static_routing`)."""
    dims = dims or cfg.dist.dims(info.world_size)
    check_adapter_layout(cfg.adapter, dims)
    check_pairs_layout(cfg.task, dims)
    parallel = build_parallelism(dims, info)
    if simulated is not None:
        parallel.simulate_world(simulated)
    building = building or contextlib.nullcontext()
    seed_everything(cfg.seed)  # a data builder drawing from the global generators: seeded
    data, data_extras = build_data(cfg.data)
    check_samples(data, cfg.data["_target_"])
    if static_shapes:
        check_static_shapes(cfg, data)
    seed_everything(cfg.seed)  # same initial weights on every rank, whatever the data drew
    with building:
        model, model_extras = build_model(cfg.model, info)
        if static_shapes:
            check_static_routing(cfg, model)
        shards, fake = parallel.shards_parameters, simulated is not None
        adapter = build_adapter(cfg, model, info, shards, fake)
    length_key = "data.max_length" if "max_length" in cfg.data else "data.block_size"
    check_fits(model, data, cfg.model, length_key)
    task = build_task(cfg.task)
    check_pairs_task(task, cfg.data["_target_"])
    # Of the whole model, before pipeline stages prune it to their own parameters.
    flops = flops_per_token(model, data.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # A frozen weight (a base under adapters) has no weight gradient: of its 6 FLOPs per token
    # (forward 2, input gradient 2, weight gradient 2) it costs 4, so MFU is not overstated.
    flops -= 2.0 * (n_params - n_trainable)
    try:  # a task's own parameters (a learned temperature) train and save with the model
        attach_loss_parameters(model, task, info.device)
    except ValueError as exc:
        raise ConfigError("task", str(exc)) from None
    with building:  # fp8: the planner's fake model plans as bf16, not converted
        fp8 = cfg.train.precision == "fp8" and simulated is None
        float8 = to_float8(model, cfg.train, info, dims) if fp8 else None
    # task=dpo: the initial policy, before layout and after fp8's conversion (a copy is then
    # float8 as the policy is: at step 1 the two cancel).
    attach_reference(task, model, adapter)
    param_dtype = parameter_dtype(cfg.train.precision, dims, info)
    # (the planner's model is fake tensors: no pass)
    reference = layout_reference_file(cfg, task, model, data, dims, info, simulated is not None)
    with building:
        wrapped = parallelize(
            model,
            model_extras,
            parallel,
            compile=cfg.train.compile,
            compile_mode=cfg.train.compile_mode,
            param_dtype=param_dtype,
        )
        lay_out_reference(
            task,
            parallel,
            lambda ref: parallelize(ref, model_extras, parallel, param_dtype=param_dtype),
            info.is_main and simulated is None,
        )
    # The pass scores with the model as the run lays it out (FSDP2: sharded, so a model that
    # fits only sharded precomputes too).
    precompute_reference(reference, task, model, data, info, parallel)
    return Assembly(
        model,
        wrapped,
        model_extras,
        parallel,
        task,
        data,
        data_extras,
        flops,
        n_params,
        adapter,
        n_trainable,
        float8,
    )
