"""The parts every command builds the same way from a config: the model laid out over the
job's ranks, its task, its data. Training (`trainer.run.build`), evaluation (`trainer.evaluate`),
export (`scripts/export_hf.py`) and planning all call these, so none of them assembles a
model that training would not."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from torch import nn

from engine.distributed import DistInfo
from engine.model import DeclaresContext, DeclaresVocabulary, flops_per_token
from engine.parallel.dims import ParallelDims
from engine.rng import seed_everything
from engine.step import Task
from engine.window_task import WindowTask, attach_loss_parameters
from trainer.config.components import check, instantiate
from trainer.config.errors import ConfigError
from trainer.config.schema import CONFIG_DIR, EXTRAS, Config, DataExtras, ModelExtras
from trainer.data import DataSplits, PadCollate, as_splits
from trainer.data.checks import check_samples
from trainer.data.pairs import PairCollate
from trainer.run.compatibility import Choices
from trainer.run.extensions import Extensions
from trainer.run.layout import build_parallelism, parallelize, parameter_dtype
from trainer.run.parts import Assembly, Parts


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


def assemble(
    cfg: Config,
    info: DistInfo,
    dims: ParallelDims | None = None,
    building: contextlib.AbstractContextManager | None = None,
    simulated: dict[Any, Any] | None = None,
    static_shapes: bool = False,
    extensions: Extensions | None = None,
) -> Assembly:
    """Seed, build the data, model and task, check that they fit, and lay the model out over
    the ranks (`dims`, by default `dist.*`'s in this world), each feature taking part at its
    points (trainer/run/extensions/). The compatibility table refuses what the config decides
    before any process group, and each row that needs a built part as soon as it is built (a
    refusal of the data before any model is built; of the model before it is converted,
    compiled, laid out or scores a reference). The model is built and laid out within
    `building` (the planner's fake tensors); the mesh and the data never are. With `simulated`
    (trainer.plan), this rank runs alone in a simulated world. `static_shapes`: training's
    assembly (CUDA graphs, which need shapes that do not vary, are captured there).
    `extensions`: the features that take part (default: trainer/run/extensions' own)."""
    dims = dims or cfg.dist.dims(info.world_size)
    choices = Choices.of(cfg, dims, training=static_shapes).checked()
    extensions = extensions or Extensions.of_run()
    parallel = build_parallelism(dims, info)
    if simulated is not None:
        parallel.simulate_world(simulated)
    seed_everything(cfg.seed)  # a data builder drawing from the global generators: seeded
    data, data_extras = build_data(cfg.data)
    check_samples(data, cfg.data["_target_"])
    pads = isinstance(data.collate_fn, PadCollate | PairCollate)
    choices = choices.knowing(pads_batches=pads, data_description=data.description).checked()
    building = building or contextlib.nullcontext()
    parts = Parts(cfg, info, dims, parallel, data, data_extras, building)
    parts = parts.replace(simulated=simulated is not None, training=static_shapes)
    seed_everything(cfg.seed)  # same initial weights on every rank, whatever the data drew
    with parts.building:
        model, model_extras = build_model(cfg.model, info)
    choices = choices.knowing(model=model).checked()
    parts = extensions.model_built(parts.replace(model=model, model_extras=model_extras))
    length_key = "data.max_length" if "max_length" in cfg.data else "data.block_size"
    check_fits(model, data, cfg.model, length_key)
    task = build_task(cfg.task)
    choices = choices.knowing(task=task).checked()
    parts = parts.replace(task=task)
    flops, n_params, n_trainable = parameter_counts(parts)
    try:  # a task's own parameters (a learned temperature) train and save with the model
        attach_loss_parameters(model, task, info.device)
    except ValueError as exc:
        raise ConfigError("task", str(exc)) from None
    param_dtype = parameter_dtype(cfg.train.precision, dims, info)
    parts = extensions.before_layout(parts.replace(param_dtype=param_dtype))
    with parts.building:
        wrapped = parallelize(
            model,
            model_extras,
            parallel,
            compile=cfg.train.compile,
            compile_mode=cfg.train.compile_mode,
            param_dtype=param_dtype,
        )
    parts = extensions.after_layout(parts.replace(wrapped=wrapped))
    return Assembly(parts, flops, n_params, n_trainable, extensions, choices)


def parameter_counts(parts: Parts) -> tuple[float, int, int]:
    """FLOPs per token, parameters and trainable parameters of the whole model, before
    pipeline stages prune it to their own parameters. A frozen weight (a base under adapters)
    has no weight gradient: of its 6 FLOPs per token (forward 2, input gradient 2, weight
    gradient 2) it costs 4, so MFU is not overstated."""
    model = parts.built_model()
    flops = flops_per_token(model, parts.data.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return flops - 2.0 * (n_params - n_trainable), n_params, n_trainable
