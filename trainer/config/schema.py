"""The config schema, registered in Hydra's ConfigStore.

The trainer's own settings (`train`, `eval`, `checkpoint`, `dist`, `logger`) are dataclasses:
Hydra checks names and types against them while composing, and `__post_init__` checks values
when `OmegaConf.to_object` builds them, before any work starts. The components a user can
swap (`model`, `task`, `data`, `optim`, `scheduler`, `step`, `callbacks.*`) are open nodes of
`_target_` plus arguments, checked against their target's signature instead
(`trainer/config/components.py`). Each builder receives only its own sub-config.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from engine.moe.modes import BALANCE_MODES
from engine.numerics import FP8_INSTALL, PRECISIONS
from engine.parallel import LayoutError
from engine.parallel.dims import ParallelDims
from trainer.config.errors import ConfigError, require

# The config groups cumulus ships (configs/<group>/*.yaml): found without importing torch, so
# that composing a config (`--help`, a refused override) stays cheap.
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"

# The keys whose 0 turns something off, and what: said by their errors (`null` included, which
# a user may try for "never").
OFF_AT_ZERO = {
    "eval.every_steps": "evaluation",
    "eval.sample_tokens": "the text sample",
    "checkpoint.every_steps": "checkpoints",
}

# torch.compile's modes (torch._inductor.list_mode_options() of torch 2.13): train.compile_mode.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "lite")
# The modes that capture CUDA graphs: they need the same shapes on every call.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _positive(value: int | float | None, key: str) -> None:
    require(value is not None and value > 0, key, f"must be a positive number, got {value!r}")


@dataclass
class TrainCfg:
    max_steps: int = 600  # optimizer steps to run (a larger value extends a finished run)
    # A number, or `auto` (with global_batch_size): the largest that fits
    # (trainer/run/auto_batch.py).
    micro_batch_size: Any = 16
    grad_accum_steps: int = 2  # micro-batches per optimizer step per rank
    # When set, grad_accum_steps is derived as global / (micro * world size).
    global_batch_size: int | None = None
    # Max total gradient norm (of the unscaled gradients, before clipping); null: no clipping.
    clip_grad_norm: float | None = 1.0
    # fp32, bf16 (autocast), fp16 (autocast and GradScaler) or fp8 (float8 Linear layers, torchao).
    precision: str = "fp32"
    # fp8 on a device without float8 matmuls (a CPU, a GPU before Ada/Hopper): emulate their
    # casts in higher precision. Slow: for checking fp8's numerics only, never for speed.
    fp8_emulate: bool = False
    # Optimizer steps between records (console, metrics.jsonl, trackers); the last step has one.
    log_every: int = 10
    # Stop after this many consecutive steps skipped for non-finite gradients.
    max_consecutive_skips: int = 10
    compile: bool = False  # torch.compile the model
    # torch.compile's mode (with compile=true); null: its default. reduce-overhead: CUDA
    # graphs (static shapes only), max-autotune: autotuned kernels and CUDA graphs.
    compile_mode: str | None = None
    # Slow: records where a NaN/Inf first appears in backward. For debugging only.
    detect_anomaly: bool = False
    # total: one global norm per record. per_layer: also grad_norm/<layer> for every block.
    grad_norms: str = "total"
    device: str = "auto"  # auto (each rank's GPU with CUDA, else the CPU), cpu or cuda
    # Measure each rank's tensor memory over the first steps (trainer/run/memory.py, the planner's
    # tracker on real tensors) and write memory_report.json in the run directory.
    memory_report: bool = False

    def __post_init__(self) -> None:
        _positive(self.max_steps, "train.max_steps")
        require(
            self.micro_batch_size == "auto"
            or (type(self.micro_batch_size) is int and self.micro_batch_size > 0),
            "train.micro_batch_size",
            f"must be a positive number or auto, got {self.micro_batch_size!r}",
        )
        _positive(self.grad_accum_steps, "train.grad_accum_steps")
        _positive(self.log_every, "train.log_every")
        _positive(self.max_consecutive_skips, "train.max_consecutive_skips")
        if self.global_batch_size is not None:
            _positive(self.global_batch_size, "train.global_batch_size")
        if self.clip_grad_norm is not None:
            _positive(self.clip_grad_norm, "train.clip_grad_norm")
        require(
            self.precision in PRECISIONS,
            "train.precision",
            f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}",
        )
        self._check_fp8()
        self._check_compile_mode()
        require(
            self.grad_norms in ("total", "per_layer"),
            "train.grad_norms",
            f"must be total or per_layer, got {self.grad_norms!r}",
        )
        require(
            self.device in ("auto", "cpu", "cuda"),
            "train.device",
            f"must be auto, cpu or cuda, got {self.device!r}",
        )

    def _check_fp8(self) -> None:
        if self.precision == "fp8":
            require(
                importlib.util.find_spec("torchao") is not None,
                "train.precision",
                f"fp8 needs torchao, which is not installed: {FP8_INSTALL}",
            )
        require(
            not self.fp8_emulate or self.precision == "fp8",
            "train.fp8_emulate",
            f"emulates float8 matmuls for train.precision=fp8; this run's precision is "
            f"{self.precision} (set train.precision=fp8, or leave train.fp8_emulate=false)",
        )

    def _check_compile_mode(self) -> None:
        if self.compile_mode is None:
            return
        require(
            self.compile_mode in COMPILE_MODES,
            "train.compile_mode",
            f"must be null (torch.compile's default) or one of {', '.join(COMPILE_MODES)}, "
            f"got {self.compile_mode!r}",
        )
        require(
            self.compile,
            "train.compile_mode",
            f"is torch.compile's mode; set train.compile=true to compile with "
            f"{self.compile_mode}, or leave train.compile_mode=null",
        )


# Keys of the `model`, `data` and `task` groups that the trainer reads itself; every other key
# of those groups is an argument of their `_target_` (trainer/config/components.py).
@dataclass
class ModelExtras:
    # Recompute each block in backward instead of keeping its activations.
    activation_checkpointing: bool = False
    # Class names of the blocks FSDP shards and activation checkpointing wraps, for models
    # that do not declare them (`block_modules()`, or Hugging Face's `_no_split_modules`).
    block_classes: list[str] | None = None


@dataclass
class DataExtras:
    # DataLoader worker processes per rank; null: 4 with CUDA (capped by the CPUs per local
    # rank), 0 on CPU (workers would compete with training for the same cores).
    num_workers: int | None = None
    # shuffle: epoch-wise permutations, a fixed global batch. poisson: every sample joins each
    # step with probability global batch / dataset size (the sampling DP-SGD's accounting
    # assumes; the batch size varies). For step=dp_sgd.
    sampling: str = "shuffle"

    def __post_init__(self) -> None:
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 or null, got {self.num_workers}")
        if self.sampling not in ("shuffle", "poisson"):
            raise ValueError(f"sampling must be shuffle or poisson, got {self.sampling!r}")


@dataclass
class TaskExtras:
    # Check once per launch, on the first window, that the task's loss is a sum over its
    # items (trainer/run/sum_check.py); false for a loss that is deliberately not one.
    check_sum: bool = True


EXTRAS = {"model": ModelExtras, "data": DataExtras, "task": TaskExtras}


TRACKERS = ("wandb", "tensorboard", "mlflow")
# How to install each tracker's package: W&B is a dependency, the others are extras.
TRACKER_INSTALL = {
    "wandb": "pip install wandb",
    "tensorboard": "pip install -e '.[tensorboard]' (the extra `tensorboard`)",
    "mlflow": "pip install -e '.[mlflow]' (the extra `mlflow`: mlflow-skinny)",
}


@dataclass
class TensorboardCfg:
    # Where this run's event files go; null: `tensorboard/` in the run directory.
    dir: str | None = None


@dataclass
class MlflowCfg:
    # null: a local store in the run directory (`mlruns/`); or a server (`http://HOST:5000`),
    # `databricks`, or any URI MLflow accepts.
    tracking_uri: str | None = None
    experiment: str = "cumulus"  # the MLflow experiment's name
    run_name: str | None = None  # the MLflow run's name; null: the run directory's
    # At the end of the run: its small files (config, metrics.jsonl, report.html, summary) as
    # the MLflow run's artifacts (never checkpoints).
    log_artifacts: bool = True


@dataclass
class LoggerCfg:
    """The trackers beside metrics.jsonl. `logger=[wandb,tensorboard]` merges the selected
    files of configs/logger/, each adding its name to `trackers` (Hydra merges mappings, so
    any number compose); the W&B keys stay at the top (`logger.project`, `logger.mode`...)."""

    # The selected trackers (set by selecting logger=NAME, not by hand).
    trackers: dict[str, bool] = field(default_factory=dict)
    # W&B (logger=wandb).
    project: str = "cumulus"
    entity: str | None = None  # the W&B team or user; null: the credentials' default
    run_name: str | None = None  # the W&B run's name; null: W&B makes one up
    tags: list[str] = field(default_factory=list)  # W&B tags of the run
    # null: online when credentials exist, offline otherwise. Or online / offline / disabled.
    mode: str | None = None
    tensorboard: TensorboardCfg = field(default_factory=TensorboardCfg)
    mlflow: MlflowCfg = field(default_factory=MlflowCfg)

    def __post_init__(self) -> None:
        unknown = [name for name in self.trackers if name not in TRACKERS]
        require(
            not unknown,
            "logger",
            f"unknown tracker {', '.join(map(repr, unknown))}: choose any of "
            f"{', '.join(TRACKERS)} (`logger=[wandb,tensorboard]`), or `logger=none`",
        )
        require(
            self.mode in (None, "online", "offline", "disabled"),
            "logger.mode",
            f"must be null, online, offline or disabled, got {self.mode!r}",
        )
        for name in self.names:
            require(
                importlib.util.find_spec(name) is not None,
                "logger",
                f"logger={name} needs the {name} package, which is not installed: "
                f"{TRACKER_INSTALL[name]}; or choose another tracker",
            )

    @property
    def names(self) -> tuple[str, ...]:
        """The selected trackers, in the order they were selected."""
        return tuple(name for name, on in self.trackers.items() if on)


@dataclass
class EvalCfg:
    every_steps: int = 100  # optimizer steps between evaluations; 0 disables
    max_batches: int | None = 20  # validation batches per evaluation; null: the whole split
    batch_size: int = 16  # validation samples per batch per rank
    # Bytes of text the GPT writes at each evaluation (console and W&B); 0 disables.
    sample_tokens: int = 200

    def __post_init__(self) -> None:
        for key, value in (
            ("sample_tokens", self.sample_tokens),
            ("every_steps", self.every_steps),
        ):
            require(
                value >= 0,
                f"eval.{key}",
                f"must be >= 0, got {value}: {off_at_zero(f'eval.{key}')}",
            )
        _positive(self.batch_size, "eval.batch_size")
        if self.max_batches is not None:
            _positive(self.max_batches, "eval.max_batches")


@dataclass
class CheckpointCfg:
    every_steps: int = 100  # optimizer steps between checkpoints; 0 disables
    keep_last: int = 2  # how many checkpoints to keep (older ones are deleted)
    resume: str = "auto"  # auto | never | a checkpoint or run directory
    # Write on a background thread from a CPU snapshot (training stalls only for the copy).
    async_save: bool = False
    # full: rank 0 gathers the whole model and optimizer state into one file (portable; needs
    # the full state in one host's memory). sharded: every rank writes its own shards with
    # torch.distributed.checkpoint (run dir on a shared filesystem). auto: sharded under
    # dist.strategy=fsdp on several ranks (pipeline stages too), full otherwise. Both resume on
    # any world size, strategy and pipeline split.
    format: str = "auto"
    # A checkpoint that cannot be written (disk full, quota): stop with a non-zero exit, or
    # warn and try again at the next checkpoint step. Either way the last one stays intact.
    on_write_error: str = "stop"

    def __post_init__(self) -> None:
        key = "checkpoint.every_steps"
        require(
            self.every_steps >= 0, key, f"must be >= 0, got {self.every_steps}: {off_at_zero(key)}"
        )
        require(
            self.on_write_error in ("stop", "warn"),
            "checkpoint.on_write_error",
            f"must be stop or warn, got {self.on_write_error!r}",
        )
        _positive(self.keep_last, "checkpoint.keep_last")
        require(bool(self.resume), "checkpoint.resume", "must be auto, never or a path")
        require(
            self.format in ("auto", "full", "sharded"),
            "checkpoint.format",
            f"must be auto, full or sharded, got {self.format!r}",
        )


@dataclass
class DistCfg:
    backend: str | None = None  # null: nccl with CUDA, gloo otherwise
    strategy: str = "ddp"  # ddp | fsdp (FSDP2: shards params, grads, optimizer state)
    # FSDP: reduce-scatter gradients after every micro-batch instead of keeping the window's
    # unsharded gradients until the last one (less memory, more communication). Under DDP it
    # likewise all-reduces every micro-batch.
    fsdp_sync_every_micro_batch: bool = False
    # How long a collective (and auto micro-batch's out-of-memory agreement) may wait.
    timeout_s: float = 600.0
    # Pipeline parallelism (engine/parallel/pipeline/): the model's blocks in `pp` stages (times
    # `pp_virtual` per rank with interleaved_1f1b), balanced by parameter count or starting
    # at the block indices `pp_split`; the world is pp x data-parallel ranks.
    pp: int = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    pp_virtual: int = 1  # stages per rank (interleaved_1f1b)
    pp_split: list[int] | None = None  # the block indices where stages 2.. begin
    # Tensor parallelism (engine/parallel/tensor.py): the model's linear layers split over
    # `tp` ranks by its plan; the world is pp x data-parallel x tp ranks.
    tp: int = 1
    # Megatron's sequence parallelism on top of `tp`: norms and dropout on sequence shards.
    tp_sequence_parallel: bool = False
    # Context parallelism (engine/parallel/context.py): each sequence split over `cp` ranks
    # (chunks r and 2cp-1-r: the causal load balance), attention over the whole sequence;
    # the world is pp x data-parallel x cp x tp ranks. `allgather`: keys and values gathered
    # along the sequence (any backend); `ring`: torch's ring attention (CUDA kernels only).
    cp: int = 1
    cp_impl: str = "allgather"  # allgather | ring
    # Expert parallelism (engine/parallel/expert.py): a mixture's experts split over `ep`
    # ranks carved from the data-parallel ranks (ep divides dp), tokens sent all-to-all.
    ep: int = 1

    def __post_init__(self) -> None:
        require(
            self.backend in (None, "nccl", "gloo"),
            "dist.backend",
            f"must be null, nccl or gloo, got {self.backend!r}",
        )
        self.dims()  # every layout check that needs no world size, before any work

    def dims(self, world: int | None = None) -> ParallelDims:
        """The degrees of parallelism these settings ask for (in a world of `world` ranks,
        checked to divide it); a layout that cannot exist is a `ConfigError` naming its key."""
        try:
            return ParallelDims(
                pp=self.pp,
                tp=self.tp,
                strategy=self.strategy,
                pp_schedule=self.pp_schedule,
                pp_virtual=self.pp_virtual,
                pp_split=None if self.pp_split is None else tuple(self.pp_split),
                sequence_parallel=self.tp_sequence_parallel,
                cp=self.cp,
                cp_impl=self.cp_impl,
                ep=self.ep,
                world=world,
            )
        except LayoutError as exc:
            raise ConfigError(exc.key, str(exc)) from None


ADAPTERS = ("none", "lora")


@dataclass
class AdapterCfg:
    """`adapter=lora` (configs/adapter/): LoRA adapters built by `peft` on a frozen base
    (trainer/models/lora.py); `adapter=none` trains every weight. The LoRA keys are null under
    `adapter=none`, so setting one without selecting `adapter=lora` is an error, not a no-op."""

    kind: str = "none"  # none | lora: what the selected file of configs/adapter/ sets
    r: int | None = None  # the adapters' rank
    alpha: float | None = None  # their scale is alpha / r
    dropout: float | None = None  # on the adapters' input
    # Module names (the last part of a path, e.g. [q_proj, v_proj]) or `all-linear` (every
    # linear layer but the output layer).
    target_modules: Any = None
    modules_to_save: list[str] | None = None  # modules trained whole (a new head, a norm)
    use_dora: bool | None = None  # weight-decomposed LoRA (DoRA)

    def __post_init__(self) -> None:
        require(
            self.kind in ADAPTERS,
            "adapter",
            f"must be one of {', '.join(ADAPTERS)} (adapter=lora), got {self.kind!r}",
        )
        lora = {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": self.target_modules,
            "modules_to_save": self.modules_to_save,
            "use_dora": self.use_dora,
        }
        if self.kind == "none":
            for name, value in lora.items():
                require(
                    value is None,
                    f"adapter.{name}",
                    "is set but no adapter is selected: add adapter=lora (the default is "
                    "adapter=none, which trains every weight)",
                )
            return
        require(
            isinstance(self.r, int) and self.r > 0, "adapter.r", f"must be >= 1, got {self.r!r}"
        )
        _positive(self.alpha, "adapter.alpha")
        require(
            self.dropout is not None and 0.0 <= self.dropout < 1.0,
            "adapter.dropout",
            f"must be in [0, 1), got {self.dropout!r}",
        )
        targets = self.target_modules
        require(
            targets == "all-linear"
            or (
                isinstance(targets, list | tuple)
                and len(targets) > 0
                and all(isinstance(t, str) and t for t in targets)
            ),
            "adapter.target_modules",
            f"must be all-linear or a list of module names (e.g. [q_proj,v_proj]), got {targets!r}",
        )


@dataclass
class ProfileCfg:
    """`profile=torch` (configs/profile/): torch.profiler over optimizer steps `steps` (first
    and last, inclusive) on `ranks` (null: every rank); each rank writes its own trace to
    RUN_DIR/profile/ and rank 0 merges them into timeline.json.gz (trainer/tracking/profiler.py).
    `profile=none` (the default) profiles nothing; phase times are recorded either way."""

    kind: str = "none"  # none | torch: what the selected file of configs/profile/ sets
    steps: list[int] = field(default_factory=lambda: [3, 4])  # [FIRST, LAST] optimizer steps
    ranks: list[int] | None = None  # the ranks that trace; null: every rank
    # CUDA: record the allocator's history (Python stacks, the last `memory_entries` events)
    # and dump a snapshot on out-of-memory (and after the profiled steps) to RUN_DIR/profile/.
    memory: bool = False
    memory_entries: int = 100_000  # allocator events kept in the history

    def __post_init__(self) -> None:
        require(
            self.kind in ("none", "torch"),
            "profile",
            f"must be none or torch (profile=torch), got {self.kind!r}",
        )
        steps = list(self.steps)
        require(
            len(steps) == 2 and all(type(s) is int for s in steps) and 1 <= steps[0] <= steps[1],
            "profile.steps",
            f"must be [FIRST, LAST]: optimizer steps, 1 <= FIRST <= LAST, got {steps!r}",
        )
        require(
            self.ranks is None or all(type(r) is int and r >= 0 for r in self.ranks),
            "profile.ranks",
            f"must be null (every rank) or a list of ranks, got {self.ranks!r}",
        )
        _positive(self.memory_entries, "profile.memory_entries")


@dataclass
class PlanCfg:
    """`python -m trainer.plan` (trainer/planning/): the simulated world and its GPUs."""

    world: int = 8  # GPUs of the simulated world
    gpu: str = "h100"  # trainer/planning/gpus.py: memory, peak FLOP/s, links
    memory_bytes: int | None = None  # the GPU's memory, if not the data sheet's
    # Also rank the valid layouts of `world` by predicted step time (a mixture of experts':
    # each dist.ep that divides the world and the expert count, DDP or FSDP2).
    search: bool = False
    out: str = "plan.json"  # where the plan is written
    # Memory kept free for what no tensor tracker sees (CUDA context, NCCL, fragmentation).
    headroom: float = 0.1
    gpus_per_node: int = 8  # which links are fast (within a node) and which are not
    # Simulate every block and micro-batch; by default a stage of more than 3 alike blocks is
    # simulated with 2 and 3 and extrapolated (trainer/planning/extrapolate.py: within 1% of
    # the full run), and a steady step of plain accumulation without a pipeline with 3 of its
    # micro-batches (trainer/planning/simulate.py: the same peak, the traffic scaled).
    full: bool = False

    def __post_init__(self) -> None:
        from trainer.planning.gpus import GPUS

        _positive(self.world, "plan.world")
        _positive(self.gpus_per_node, "plan.gpus_per_node")
        require(
            self.gpu in GPUS,
            "plan.gpu",
            f"must be one of {', '.join(GPUS)}, got {self.gpu!r}",
        )
        require(0 <= self.headroom < 1, "plan.headroom", f"must be in [0, 1), got {self.headroom}")


@dataclass
class MoECfg:
    """`moe.*`: how the routers of a mixture-of-experts model are balanced
    (engine/moe/balance.py); a dense model ignores it."""

    # global: the load-balancing loss of the whole step, exact; micro: per micro-batch (the
    # peers' approximation); bias: no loss, a routing bias moved after each step from the
    # whole step's counts (DeepSeek-V3); none: no balancing; seq_aux: Megatron's
    # sequence-level loss, each sequence's own f and P averaged over the step's sequences.
    balance: str = "global"
    # The load-balancing loss's weight; null: the model's own (transformers' mixtures: their
    # config's router_aux_loss_coef; the in-tree GPT: 0.01, Switch's).
    aux_coef: float | None = None
    z_coef: float = 0.0  # the router z-loss's weight
    # bias: how far each expert's routing bias moves per step (DeepSeek-V3's gamma).
    bias_rate: float = 0.001

    def __post_init__(self) -> None:
        require(
            self.balance in BALANCE_MODES,
            "moe.balance",
            f"must be one of {', '.join(BALANCE_MODES)}, got {self.balance!r}",
        )
        require(
            self.aux_coef is None or self.aux_coef >= 0,
            "moe.aux_coef",
            f"must be >= 0 or null (the model's own), got {self.aux_coef}",
        )
        require(self.z_coef >= 0, "moe.z_coef", f"must be >= 0, got {self.z_coef}")
        require(self.bias_rate >= 0, "moe.bias_rate", f"must be >= 0, got {self.bias_rate}")


# How to install torchft for ft=torchft (the extra `ft`).
FT_INSTALL = "pip install 'cumulus[ft]' (or pip install -e '.[ft]' in a checkout)"
# torchft reads these at its Manager's start and lets them override what it is given.
FT_ENV_OVERRIDES = (
    "TORCHFT_TIMEOUT_SEC",
    "TORCHFT_QUORUM_TIMEOUT_SEC",
    "TORCHFT_CONNECT_TIMEOUT_SEC",
)


@dataclass
class FtCfg:
    """`ft=torchft` (configs/ft/): replica groups coordinated by torchft, the lost share of a
    step redone by the live groups (trainer/run/ft.py, engine/parallel/replicas.py);
    `ft=none` (the default) has none."""

    kind: str = "none"  # none | torchft: what the selected file of configs/ft/ sets
    # The lighthouse's address (http://HOST:PORT, `python -m trainer.lighthouse` prints it);
    # null: the environment's TORCHFT_LIGHTHOUSE.
    lighthouse: str | None = None
    # This replica group's id, 0 .. groups - 1; the lowest live id writes records and
    # checkpoints.
    group: int = 0
    # Replica groups in the job: the global batch is dealt over the live ones.
    groups: int = 1
    # No step commits with fewer live groups (give the lighthouse the same --min-groups).
    min_groups: int = 1
    # How long a dead or hung group may stall a step (a cross-group collective, the quorum, a
    # state transfer), and how long an unreachable lighthouse is waited for.
    timeout_s: float = 30.0
    # The quorum of a step after a committed one forms while its first forward runs, on the
    # last quorum's deal (torchft's async quorum); false: each quorum before the step.
    async_quorum: bool = True

    def __post_init__(self) -> None:
        require(
            self.kind in ("none", "torchft"),
            "ft",
            f"must be none or torchft (ft=torchft), got {self.kind!r}",
        )
        if self.kind == "none":
            return
        require(
            importlib.util.find_spec("torchft") is not None,
            "ft",
            f"ft=torchft needs torchft, which is not installed: {FT_INSTALL}",
        )
        require(
            type(self.groups) is int and self.groups >= 1,
            "ft.groups",
            f"must be a positive number of replica groups, got {self.groups!r}",
        )
        require(
            type(self.group) is int and 0 <= self.group < self.groups,
            "ft.group",
            f"must be this replica group's id, 0 .. {self.groups - 1} (ft.groups="
            f"{self.groups}), got {self.group!r}",
        )
        require(
            type(self.min_groups) is int and 1 <= self.min_groups <= self.groups,
            "ft.min_groups",
            f"must be from 1 to ft.groups ({self.groups}): no step could ever commit with "
            f"{self.min_groups!r}",
        )
        _positive(self.timeout_s, "ft.timeout_s")
        require(
            bool(self.address),
            "ft.lighthouse",
            "ft=torchft needs the lighthouse's address: set ft.lighthouse=http://HOST:PORT "
            "(what `python -m trainer.lighthouse` prints) or TORCHFT_LIGHTHOUSE",
        )
        overrides = [f"{k}={os.environ[k]}" for k in FT_ENV_OVERRIDES if k in os.environ]
        require(
            not overrides,
            "ft.timeout_s",
            f"{', '.join(overrides)} would override it inside torchft, silently; unset "
            "the variable and set ft.timeout_s instead",
        )

    @property
    def enabled(self) -> bool:
        return self.kind == "torchft"

    @property
    def address(self) -> str:
        """The lighthouse's address: `lighthouse`, else $TORCHFT_LIGHTHOUSE ('' when neither)."""
        return self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")


ROLLOUT_ENGINES = ("transformers", "recompute", "vllm")


@dataclass
class RolloutCfg:
    """`rollout.*`: which engine task=grpo's policy generates with, and how its completions
    are batched for training (trainer/rollout/: one group per call, each completion its own
    random stream). What is drawn, `task.max_new_tokens`, `task.temperature` and
    `task.top_p`, is the task's (configs/task/grpo.yaml, trainer/rollout/task.py)."""

    # transformers (generate with its KV cache), recompute (any model returning logits: the
    # whole sequence each token), vllm (GPU, colocated: not built yet); null: transformers for
    # a transformers model, else recompute.
    engine: str | None = None
    # Completions per training micro-batch; null: train.micro_batch_size x task.num_generations
    # (each prompt micro-batch's completions).
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        require(
            self.engine is None or self.engine in ROLLOUT_ENGINES,
            "rollout.engine",
            f"must be one of {', '.join(ROLLOUT_ENGINES)} or null, got {self.engine!r}",
        )
        if self.micro_batch_size is not None:
            _positive(self.micro_batch_size, "rollout.micro_batch_size")


@dataclass
class RewardCfg:
    """`reward=[exact_answer,format,...]` (configs/reward/): task=grpo's reward functions,
    TRL's signature `fn(prompts, completions, completion_ids, **row_fields) -> list[float]`
    (trainer/rollout/rewards.py). A completion's reward is the sum of weight x score."""

    # NAME: {_target_: pkg.fn, <its keyword arguments>}; NAME names the record
    # train/reward/NAME.
    funcs: dict[str, Any] = field(default_factory=dict)
    # NAME: weight (1.0 for a function not listed), e.g. reward.weights.format=0.2; a NAME
    # that is not in funcs is refused.
    weights: dict[str, float] = field(default_factory=dict)


def off_at_zero(key: str) -> str:
    """What a key of `OFF_AT_ZERO` says of its 0 ("eval.every_steps=0 disables evaluation")."""
    return f"{key}=0 disables {OFF_AT_ZERO[key]}"


def _component(**defaults: Any) -> Any:
    """A component node: `_target_` plus arguments, open to any key (its target's signature
    decides which are valid, checked by trainer/config/components.py)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(defaults, flags={"struct": False})


@dataclass
class Config:
    seed: int = 1337  # one seed for everything (weights, data order, dropout)
    train: TrainCfg = field(default_factory=TrainCfg)
    # Components: `_target_` + keyword arguments (configs/<group>/*.yaml, or a user's own).
    model: Any = field(default_factory=_component)
    task: Any = field(default_factory=_component)
    data: Any = field(default_factory=_component)
    optim: Any = field(default_factory=_component)
    scheduler: Any = field(default_factory=_component)
    logger: LoggerCfg = field(default_factory=LoggerCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    checkpoint: CheckpointCfg = field(default_factory=CheckpointCfg)
    dist: DistCfg = field(default_factory=DistCfg)
    # A step strategy: `_target_` plus its keyword arguments.
    step: Any = field(
        default_factory=lambda: _component(_target_="engine.steps.accumulate.AccumulateStep")
    )
    callbacks: dict[str, Any] = field(default_factory=dict)
    # adapter=lora: LoRA adapters on a frozen base (trainer/models/lora.py).
    adapter: AdapterCfg = field(default_factory=AdapterCfg)
    profile: ProfileCfg = field(default_factory=ProfileCfg)
    # Mixture-of-experts balancing (moe=global|micro|none).
    moe: MoECfg = field(default_factory=MoECfg)
    # Fault tolerance across replica groups (ft=torchft), or none (ft=none).
    ft: FtCfg = field(default_factory=FtCfg)
    # task=grpo: how completions are generated, and the rewards that score them.
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    reward: RewardCfg = field(default_factory=RewardCfg)
    # python -m trainer.plan only (training ignores it).
    plan: PlanCfg = field(default_factory=PlanCfg)

    def __post_init__(self) -> None:
        # A window that starts after the last step would trace nothing and exit 0 with an
        # empty profile/. One that starts inside and ends after is clipped at the last step
        # (trainer/tracking/profiler.py says so at start-up): it still traces what there is,
        # and a later run extended with a larger train.max_steps traces the window whole.
        first, last = self.profile.steps
        require(
            self.profile.kind == "none" or first <= self.train.max_steps,
            "profile.steps",
            f"[{first}, {last}] starts after the run's last step (train.max_steps="
            f"{self.train.max_steps}), so nothing would be profiled; set profile.steps to a "
            f"window that starts at a step from 1 to {self.train.max_steps} (e.g. "
            f"[{min(3, self.train.max_steps)}, {min(4, self.train.max_steps)}]) or raise "
            "train.max_steps",
        )


COMPONENTS = ("model", "task", "data", "optim", "scheduler", "step")


def register_configs() -> None:
    """The schema in Hydra's ConfigStore, once per process: storing structures the whole
    `Config` again (~16 ms), and every command and `trainer.api` call registers it."""
    store = ConfigStore.instance()
    if "config_schema.yaml" not in store.repo:
        store.store(name="config_schema", node=Config)
