"""The config schema: one dataclass per group, registered in Hydra's ConfigStore.

Hydra checks names and types against these dataclasses while composing (unknown keys and
ill-typed values fail there); `__post_init__` checks values when `OmegaConf.to_object` builds
them, before any work starts. Each component receives only its own sub-config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from engine.distributed import STRATEGIES
from engine.precision import PRECISIONS
from trainer.errors import require


def _positive(value: int | float | None, key: str) -> None:
    require(value is not None and value > 0, key, f"must be a positive number, got {value!r}")


@dataclass
class TrainCfg:
    max_steps: int = 600
    micro_batch_size: int = 16
    grad_accum_steps: int = 2
    # When set, grad_accum_steps is derived as global / (micro * world size).
    global_batch_size: int | None = None
    clip_grad_norm: float | None = 1.0
    precision: str = "fp32"
    log_every: int = 10
    max_consecutive_skips: int = 10
    compile: bool = False
    # Slow: records where a NaN/Inf first appears in backward. For debugging only.
    detect_anomaly: bool = False
    # total: one global norm per record. per_layer: also grad_norm/<layer> for every block.
    grad_norms: str = "total"
    device: str = "auto"

    def __post_init__(self) -> None:
        _positive(self.max_steps, "train.max_steps")
        _positive(self.micro_batch_size, "train.micro_batch_size")
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


@dataclass
class ModelCfg:
    """A byte-level (or token-level) GPT."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    activation_checkpointing: bool = False
    # Train the blocks' linear layers with STE fake-quantized weights of this many bits.
    fake_quant_bits: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            _positive(getattr(self, name), f"model.{name}")
        require(
            self.n_embd % self.n_head == 0,
            "model.n_embd",
            f"must be divisible by model.n_head={self.n_head}, got {self.n_embd}",
        )
        require(
            0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}"
        )
        if self.fake_quant_bits is not None:
            require(
                2 <= self.fake_quant_bits <= 16,
                "model.fake_quant_bits",
                f"must be null or in [2, 16], got {self.fake_quant_bits}",
            )


@dataclass
class DataCfg:
    # `stdlib` trains on this Python's own standard-library sources (no download). Otherwise a
    # text file, a directory of text files (matched by `glob`), or a nanoGPT-style uint16
    # token `.bin` file (or a directory holding train.bin and val.bin).
    path: str = "stdlib"
    glob: str = "*.py"
    # true: fixed-length blocks of block_size+1 tokens. false: one variable-length sample per
    # paragraph, padded per micro-batch with ignored targets.
    packed: bool = True
    block_size: int = 128
    # Every n-th file (text) goes to the validation split; for a single .bin/.txt file the
    # last 1/n of it.
    val_every_nth: int = 10
    min_sample_len: int = 8

    def __post_init__(self) -> None:
        require(bool(self.path), "data.path", "must name a file or directory, or be `stdlib`")
        require(
            self.path != "required",
            "data.path",
            "this experiment needs a token dataset: pass data.path=DIR holding train.bin and "
            "val.bin (uint16 token ids; `python scripts/prepare_bin.py DIR` writes them)",
        )
        _positive(self.block_size, "data.block_size")
        require(self.val_every_nth >= 2, "data.val_every_nth", "must be at least 2")
        require(
            2 <= self.min_sample_len <= self.block_size + 1,
            "data.min_sample_len",
            f"must be in [2, data.block_size + 1], got {self.min_sample_len}",
        )


@dataclass
class OptimCfg:
    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    # AdamW: the fused kernel skips a non-finite update on the device, with no host sync.
    # (SGD is never fused; its skip decision reads one flag on the host.)
    fused: bool = True

    def __post_init__(self) -> None:
        require(
            self.name in ("adamw", "sgd"), "optim.name", f"must be adamw or sgd, got {self.name!r}"
        )
        _positive(self.lr, "optim.lr")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")


@dataclass
class SchedulerCfg:
    name: str = "cosine"
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        require(
            self.name in ("cosine", "constant"),
            "scheduler.name",
            f"must be cosine or constant, got {self.name!r}",
        )
        require(self.warmup_steps >= 0, "scheduler.warmup_steps", "must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "scheduler.min_lr_ratio", "must be in [0, 1]")


@dataclass
class LoggerCfg:
    name: str = "wandb"
    project: str = "cumulus"
    entity: str | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    # null: online when credentials exist, offline otherwise. Or online / offline / disabled.
    mode: str | None = None

    def __post_init__(self) -> None:
        require(
            self.name in ("wandb", "none"),
            "logger.name",
            f"must be wandb or none, got {self.name!r}",
        )
        require(
            self.mode in (None, "online", "offline", "disabled"),
            "logger.mode",
            f"must be null, online, offline or disabled, got {self.mode!r}",
        )


@dataclass
class EvalCfg:
    every_steps: int = 100
    max_batches: int | None = 20
    batch_size: int = 16
    # Bytes of text the GPT writes at each evaluation (console and W&B); 0 disables.
    sample_tokens: int = 200

    def __post_init__(self) -> None:
        require(self.sample_tokens >= 0, "eval.sample_tokens", "must be >= 0 (0 disables)")
        require(self.every_steps >= 0, "eval.every_steps", "must be >= 0 (0 disables evaluation)")
        _positive(self.batch_size, "eval.batch_size")
        if self.max_batches is not None:
            _positive(self.max_batches, "eval.max_batches")


@dataclass
class CheckpointCfg:
    every_steps: int = 100
    keep_last: int = 2
    resume: str = "auto"  # auto | never | a path
    # Write on a background thread from a CPU snapshot (training stalls only for the copy).
    async_save: bool = False
    # full: rank 0 gathers the whole model and optimizer state into one file (portable; needs
    # the full state in one host's memory). sharded: every rank writes its own shards with
    # torch.distributed.checkpoint (run dir on a shared filesystem). auto: sharded under
    # dist.strategy=fsdp on several ranks, full otherwise. Both resume on any world size and
    # strategy.
    format: str = "auto"

    def __post_init__(self) -> None:
        require(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0 (0 disables)")
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
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        require(
            self.backend in (None, "nccl", "gloo"),
            "dist.backend",
            f"must be null, nccl or gloo, got {self.backend!r}",
        )
        require(
            self.strategy in STRATEGIES,
            "dist.strategy",
            f"must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}",
        )


@dataclass
class Config:
    seed: int = 1337
    train: TrainCfg = field(default_factory=TrainCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    scheduler: SchedulerCfg = field(default_factory=SchedulerCfg)
    logger: LoggerCfg = field(default_factory=LoggerCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    checkpoint: CheckpointCfg = field(default_factory=CheckpointCfg)
    dist: DistCfg = field(default_factory=DistCfg)
    # A step strategy: `_target_` plus its keyword arguments (untyped so user classes fit).
    step: Any = field(default_factory=lambda: {"_target_": "engine.accumulate.AccumulateStep"})
    callbacks: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(
            self.data.block_size <= self.model.block_size,
            "data.block_size",
            f"must be <= model.block_size={self.model.block_size}, got {self.data.block_size}",
        )


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)
