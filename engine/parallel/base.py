"""The `Parallelism` interface: everything the step, evaluation, checkpoints and the fit loop
ask about how the model is spread over ranks, and `ParallelBase`, its plain defaults.

Every member a caller uses is declared here; callers never probe for one. The defaults are
those of the whole model on every rank (one process, DDP, FSDP2): the plain accumulation loop,
no gradient sync after the window, the local gradient norm, every rank's loss counts, dropout
streams per data-parallel rank, the model's own state dicts for checkpoints. A parallelism
overrides what it does differently (the pipeline runs the window as its schedule, tensor
parallelism sums gradients after the window and reports from one rank of a group...).

The implementations, one module each: `ddp` (DDP; the bare model on one process), `fsdp`
(FSDP2), `tensor` (tensor parallelism, with sequence parallelism), `pipeline/` (stages),
`context` (context parallelism). `dims` decides the degrees once and builds the one in use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from engine.distributed import DistInfo
from engine.item_sums import ItemTotals, task_loss
from engine.parallel import LayoutError

__all__ = ["LayoutError", "MeshSplit", "ParallelBase", "Parallelism", "RunShape"]

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from engine.numerics.precision import Precision

Batch = Any  # a micro-batch, whatever the collate function made of the samples
Task = Any  # engine/step.py's Task: count_items(batch), loss_sum(model, batch)

# A function giving a batch's sums for evaluation: (task, model, batch) -> {"loss": ..., ...}.
SumsOf = Callable[[Any, Any, Any], dict[str, torch.Tensor]]
T = TypeVar("T")  # what a guarded moment returns


@dataclass(frozen=True)
class RunShape:
    """What a parallelism's `check` may refuse: the run's other choices, as plain values."""

    auto_micro_batch: bool = False
    compile: bool = False
    per_layer_norms: bool = False
    step: Any = None  # the step strategy object
    # The step is step=accumulate's window as it is (no extra passes, nothing per sample):
    # what parallelisms that split the model or the sequence over ranks run.
    plain_accumulation: bool = True
    callbacks: Any = None  # the run's CallbackList
    accum: int = 1  # micro-batches per optimizer step and rank
    checkpoint_format: str = "full"  # `full` or `sharded`, resolved


@runtime_checkable
class WindowGuard(Protocol):
    """What wraps the window's moments (engine/steps/oom.py's out-of-memory guard); the null
    guard runs each as it is."""

    def micro_batch(self, index: int, count: int, fn: Callable[[], T]) -> T:
        """Run micro-batch `index` of `count` (`fn`: its forward and backward)."""
        ...

    def gradient_sync(self, ctx: WindowContext, enabled: bool) -> contextlib.AbstractContextManager:
        """Around a micro-batch: whether and how its gradients communicate."""
        ...

    def after_window(self, ctx: WindowContext) -> None:
        """After the last micro-batch's backward."""
        ...


class NoGuard:
    """Runs every moment as it is: the parallelism's own gradient sync."""

    def micro_batch(self, index: int, count: int, fn: Callable[[], T]) -> T:
        del index, count
        return fn()

    def gradient_sync(self, ctx: WindowContext, enabled: bool) -> contextlib.AbstractContextManager:
        return ctx.parallel.gradient_sync(ctx.model, enabled)

    def after_window(self, ctx: WindowContext) -> None:
        del ctx


NO_GUARD = NoGuard()


@runtime_checkable
class WindowContext(Protocol):
    """What a parallelism reads of the step's context (engine/step.py's `StepContext`)."""

    model: nn.Module
    task: Any
    precision: Precision
    callbacks: Any  # the run's CallbackList: `after_micro_batch` after each backward
    parallel: Parallelism
    sync_every_micro_batch: bool
    grad_sync_divisor: int
    clock: Any  # engine/timing.py's PhaseClock: the window's phases and profiler spans
    step: int  # optimizer steps completed (the window makes step + 1)
    item_sums: ItemTotals  # a task's item sums of the window's forwards (engine/item_sums.py)

    def trainable_parameters(self) -> list[nn.Parameter]: ...


@runtime_checkable
class SumsAcrossGroups(Protocol):
    """A parallelism whose data-parallel ranks span replica groups (engine/parallel/replicas.py):
    what a task sums over `dp_group` before the window's backward (the balancing's routing
    counts) it also sums across the groups, rank r with rank r of every other group."""

    def sum_across_groups(self, tensor: torch.Tensor) -> None:
        """SUM `tensor` across the groups, in place (a failed sum: the step does not commit)."""
        ...

    def keyed_guard(
        self, ctx: WindowContext, micro_batches: int, guard: WindowGuard
    ) -> WindowGuard:
        """`guard` under which micro-batch i of this rank's window of `micro_batches` draws its
        randomness as its backward will (keyed by its index in the global batch): a look at
        the window before the backward (the routing pass) routes as the backward does."""
        ...


@runtime_checkable
class SettlesCount(Protocol):
    """A parallelism whose window count may take its last sum after the window's first
    forward (engine/parallel/replicas.py: across replica groups, so that torchft's quorum,
    which that sum waits for, is formed while the forward runs)."""

    def pending_item_count(self, local: torch.Tensor) -> torch.Tensor:
        """The window's count over all ranks, as `global_item_count`'s, its value final once
        `settle_count` has run (in place): read by nothing before the first backward."""
        ...

    def settle_count(self) -> None:
        """Make the pending count final (nothing pending: nothing to do)."""
        ...


@runtime_checkable
class KeepsWindowSums(Protocol):
    """A task that keeps, beside its item sums, sums of the window's forwards that it adds
    over `dp_group` after the step (the balancing's routing, for its records and the routing
    bias). Across replica groups they travel with the gradients' sum: `take_window_sums` this
    rank's, `put_window_sums` them summed with the same rank of every group, only when the
    window commits (a redone window's are dropped)."""

    def take_window_sums(self) -> dict[str, torch.Tensor]: ...

    def put_window_sums(self, sums: dict[str, torch.Tensor]) -> None: ...


_HALF = (torch.float16, torch.bfloat16)


@runtime_checkable
class Parallelism(Protocol):
    """How the model is spread over ranks: every member a caller uses."""

    name: ClassVar[str]  # the `dist.*` setting that selects it
    # Each block becomes its own unit (FSDP shards block by block): the model must declare its
    # blocks, and `torch.compile` applies per block rather than to the whole model.
    per_block: bool
    # Parameters (and optimizer state, EMA averages) are sharded over ranks: forwards run in
    # lockstep on every rank, and only sharded checkpoints hold the whole state.
    shards_parameters: bool
    # Every rank holds the whole model and can run it alone (generation, the sum check).
    whole_model: bool

    # ---- coordinates ----
    @property
    def dp_rank(self) -> int:
        """Which slice of each global batch this rank's loader reads."""
        ...

    @property
    def dp_size(self) -> int:
        """How many slices a global batch is cut into (`global = micro x accum x dp`)."""
        ...

    @property
    def dp_group(self) -> ProcessGroup | None:
        """The group over which item counts, loss sums and evaluation sums are summed (None:
        the whole world)."""
        ...

    @property
    def sync_divisor(self) -> int:
        """What the wrapper divides synchronized gradients by (the step multiplies it back)."""
        ...

    @property
    def checkpoint_format(self) -> str:
        """`checkpoint.format=auto` resolves to this: `full` or `sharded`."""
        ...

    @property
    def dropout_stream(self) -> int:
        """Which random stream this rank's dropout draws from after the shared init."""
        ...

    @property
    def reports(self) -> bool:
        """Whether this rank's loss and evaluation sums count (ranks computing the same
        values as another rank report zeros)."""
        ...

    def describe(self) -> str:
        """The banner's words for this layout ('' for plain data parallelism)."""
        ...

    def check(self, shape: RunShape) -> None:
        """Refuse (`LayoutError`) what this parallelism cannot run with the run's other
        choices: one paragraph each."""
        ...

    # ---- building ----
    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        """Wrap or shard `model` (with `blocks`, its repeated layers); returns what the step
        calls."""
        ...

    # ---- the window ----
    def global_item_count(self, local: torch.Tensor) -> torch.Tensor:
        """The window's loss items over every data-parallel rank (`local`: this rank's): the
        one all-reduce before any forward."""
        ...

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's part of a micro-batch (all of it unless the sequence is split)."""
        ...

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Around forward *and* backward of a micro-batch: communicate gradients if `enabled`."""
        ...

    def backward_window(
        self,
        ctx: WindowContext,
        window: Sequence[Batch],
        global_count: torch.Tensor,
        guard: WindowGuard = NO_GUARD,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch, gradients accumulated and synchronized;
        this rank's loss sum (detached)."""
        ...

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """After the window: the gradient communication no wrapper did."""
        ...

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The total gradient norm over every rank's gradients (float64 squares)."""
        ...

    def clip_(self, params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
        """Scale the gradients so their total norm `norm` is at most `max_norm`."""
        ...

    def agree_found_inf(self, precision: Precision, optimizer: torch.optim.Optimizer) -> None:
        """fp16: one rank's overflow skips the step on every rank holding other parameters."""
        ...

    def optimizer_context(self) -> contextlib.AbstractContextManager:
        """Around the optimizer's step, GradScaler's unscale and optimizer state loads."""
        ...

    def metrics(self, peak_mb: float) -> dict[str, float]:
        """Extra training metrics (collective: every rank calls it when a record is due)."""
        ...

    # ---- evaluation ----
    def eval_mode(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Within: the model (and whatever runs it) in eval mode; modes restored after."""
        ...

    def eval_sums(
        self,
        model: nn.Module,
        task: Task,
        batches: Iterable[Batch],
        sums_of: SumsOf,
        n_forwards: int | None = None,
    ) -> Iterator[tuple[Batch, dict[str, torch.Tensor]]]:
        """`(batch, sums)` for each batch this rank counts; with `n_forwards` (forwards are
        collective) the first batch runs again until that many went through, not yielded."""
        ...

    # ---- checkpoints ----
    # `trainable_only`: checkpoints of the trainable parameters alone (adapters on a frozen
    # base): the frozen ones are neither saved nor expected on load.
    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The whole model's and optimizer's state on rank 0 (collective; `full` layout)."""
        ...

    def load_full_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any] | None,
        trainable_only: bool = False,
    ) -> None:
        """Load a `full` checkpoint's state into this rank's part of the model."""
        ...

    def sharded_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
    ) -> dict[str, Any]:
        """This rank's shards of the model and optimizer state (`sharded` layout, DCP)."""
        ...

    def load_sharded_state(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        trainable_only: bool = False,
    ) -> None:
        """Collective: load a `sharded` checkpoint (and the tensors of `extra`, in place)."""
        ...

    # ---- a simulated world (trainer.plan) ----
    def simulate_world(self, book: dict[Any, Any]) -> None:
        """This rank runs alone on a fake process group with fake tensors (trainer.plan):
        what it would receive from peers comes from `book`, where other ranks' simulated runs
        recorded what they send. Called before `apply`."""
        ...

    def untracked_bytes(self, model: nn.Module) -> dict[str, int]:
        """Memory the layout allocates outside torch's dispatcher, which a tracker of tensors
        cannot see (DDP's gradient buckets), by what it holds."""
        ...

    # ---- out-of-memory recovery (train.micro_batch_size=auto) ----
    def guard_collectives(self, model: nn.Module, agreement: Callable[[bool], int]) -> None:
        """Make the collectives inside forward and backward agree on out-of-memory first."""
        ...

    def guarded_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Around a guarded micro-batch: only communication that agrees first may run."""
        ...

    def reduce_guarded_window(self, params: list[nn.Parameter]) -> None:
        """After a guarded window: the gradient communication `guarded_sync` held back."""
        ...

    def reset_after_oom(self, model: nn.Module) -> None:
        """After an agreed out-of-memory error: the wrapper's state of the failed window."""
        ...


class ParallelBase:
    """The plain defaults of `Parallelism`: the whole model on every rank."""

    name: ClassVar[str] = ""
    per_block = False
    shards_parameters = False
    whole_model = True

    def __init__(self, info: DistInfo, mesh: DeviceMesh | None = None) -> None:
        self.info, self.mesh = info, mesh
        self.simulated: dict[Any, Any] | None = None  # trainer.plan's record of peers

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp") if self.mesh is not None else self.info.rank

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size() if self.mesh is not None else self.info.world_size

    @property
    def dp_group(self) -> ProcessGroup | None:
        return None  # the data-parallel ranks are the whole world

    @property
    def sync_divisor(self) -> int:
        return 1

    @property
    def checkpoint_format(self) -> str:
        return "full"

    @property
    def dropout_stream(self) -> int:
        return self.dp_rank

    @property
    def reports(self) -> bool:
        return True

    def describe(self) -> str:
        return ""

    def check(self, shape: RunShape) -> None:
        averaged = shape.callbacks.averaged_weights() if shape.callbacks is not None else {}
        if self.shards_parameters and shape.checkpoint_format == "full" and averaged:
            raise LayoutError(
                "checkpoint.format",
                "under dist.strategy=fsdp the EMA callback keeps its average sharded like the "
                "parameters, and only sharded checkpoints save it; use checkpoint.format=sharded "
                "(or auto, the default)",
            )

    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        del blocks, param_dtype, reshard_after_forward
        return model

    # ---- the window ----
    def global_item_count(self, local: torch.Tensor) -> torch.Tensor:
        from engine.distributed import all_reduce_sum

        return all_reduce_sum(local, self.info, self.dp_group)

    def local_batch(self, batch: Batch) -> Batch:
        return batch

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        del model, enabled
        return contextlib.nullcontext()

    def backward_window(
        self,
        ctx: WindowContext,
        window: Sequence[Batch],
        global_count: torch.Tensor,
        guard: WindowGuard = NO_GUARD,
    ) -> torch.Tensor:
        """The plain accumulation loop: forward + backward of every micro-batch scaled by the
        window's global count, gradients communicated in the last one only (or every one with
        `sync_every_micro_batch`); each graph freed by its own backward, only the detached sum
        survives (fp32, or the loss's own precision when higher)."""
        # DDP divides the reduced gradient by its world size; multiplying by that divisor here
        # undoes it, so the result is the global mean. Guard against an all-padding window.
        loss_sum: torch.Tensor | None = None
        last = len(window) - 1
        for i, batch in enumerate(window):
            sync = i == last or ctx.sync_every_micro_batch
            with ctx.clock.span(f"micro-batch {i + 1}/{len(window)}"):
                with guard.gradient_sync(ctx, sync):
                    micro_sum = guard.micro_batch(
                        i,
                        len(window),
                        lambda b=batch, s=sync: micro_backward(ctx, b, global_count, s),
                    )
                ctx.callbacks.after_micro_batch(ctx, batch, global_count, i == last)
            loss_sum = micro_sum if loss_sum is None else loss_sum + micro_sum
        guard.after_window(ctx)
        with ctx.clock.collective("gradient sync after the window"):
            self.sync_gradients(ctx.trainable_parameters())
        assert loss_sum is not None  # a window holds at least one micro-batch
        return loss_sum if self.reports else torch.zeros_like(loss_sum)

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        del params

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            raise RuntimeError(
                "no parameter received a gradient: is the loss connected to the model?"
            )
        return total_norm(grads)

    def clip_(self, params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)

    def agree_found_inf(self, precision: Precision, optimizer: torch.optim.Optimizer) -> None:
        del precision, optimizer  # every rank holds every parameter: the same decision

    def optimizer_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def metrics(self, peak_mb: float) -> dict[str, float]:
        del peak_mb
        return {}

    # ---- evaluation ----
    @contextlib.contextmanager
    def eval_mode(self, model: nn.Module) -> Iterator[None]:
        was_training = model.training
        model.eval()
        try:
            yield
        finally:
            model.train(was_training)

    def eval_sums(
        self,
        model: nn.Module,
        task: Task,
        batches: Iterable[Batch],
        sums_of: SumsOf,
        n_forwards: int | None = None,
    ) -> Iterator[tuple[Batch, dict[str, torch.Tensor]]]:
        first, seen = None, 0
        for batch in batches:
            batch = self.local_batch(batch)
            first = batch if first is None else first
            seen += 1
            yield batch, sums_of(task, model, batch)
        for _ in range(seen, n_forwards or 0):
            sums_of(task, model, first)  # lockstep only: not counted

    # ---- checkpoints ----
    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        from engine.checkpoint import model_optimizer_state

        return model_optimizer_state(model, optimizer, trainable_only)

    def load_full_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any] | None,
        trainable_only: bool = False,
    ) -> None:
        from engine.checkpoint import check_trainable_keys, load_model_optimizer_state

        if optimizer is None or optimizer_state is None:
            if trainable_only:
                check_trainable_keys(model, model_state)
            model.load_state_dict(model_state, strict=not trainable_only)
            return
        with self.optimizer_context():  # loading initializes the optimizer's state
            load_model_optimizer_state(
                model, optimizer, model_state, optimizer_state, trainable_only
            )

    def sharded_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
    ) -> dict[str, Any]:
        from engine.checkpoint.sharded import sharded_model_optimizer_state

        return sharded_model_optimizer_state(model, optimizer, trainable_only=trainable_only)

    def load_sharded_state(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        trainable_only: bool = False,
    ) -> None:
        from engine.checkpoint.sharded import load_sharded

        with self.optimizer_context():
            load_sharded(path, model, optimizer, extra, trainable_only)

    # ---- a simulated world ----
    def simulate_world(self, book: dict[Any, Any]) -> None:
        self.simulated = book

    def untracked_bytes(self, model: nn.Module) -> dict[str, int]:
        del model
        return {}

    # ---- out-of-memory recovery ----
    def guard_collectives(self, model: nn.Module, agreement: Callable[[bool], int]) -> None:
        del model, agreement  # no collective inside forward or backward

    def guarded_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        del model, enabled
        return contextlib.nullcontext()

    def reduce_guarded_window(self, params: list[nn.Parameter]) -> None:
        del params

    def reset_after_oom(self, model: nn.Module) -> None:
        del model


class MeshSplit(ParallelBase):
    """The shared part of parallelisms that split the model over mesh dimensions besides
    `dp` (pipeline stages, tensor-parallel ranks): coordinates from the mesh, gradients summed
    by the parallelism itself after the window (`sync_divisor` 1), the total norm over the
    ranks holding different parameters, one overflow skipping every rank, and the exact
    accumulation step with callbacks that see neither single micro-batches nor every weight."""

    key: ClassVar[str] = ""  # the config key that asks for it, named in refusals
    whole_model = False

    def __init__(self, info: DistInfo, mesh: DeviceMesh) -> None:
        super().__init__(info, mesh)
        self.mesh: DeviceMesh = mesh

    @property
    def dp_group(self) -> ProcessGroup:
        return self.mesh.get_group("dp")

    def check(self, shape: RunShape) -> None:
        super().check(shape)
        refused = {
            "train.micro_batch_size": (
                shape.auto_micro_batch,
                "the automatic micro-batch is not probed with it yet",
            ),
            "train.compile": (shape.compile, "compiling it is not built yet"),
            "train.grad_norms": (
                shape.per_layer_norms,
                "per-layer norms would be recorded for this rank's share of the model only",
            ),
        }
        for k, (bad, why) in refused.items():
            if bad:
                raise LayoutError(k, f"not available with {self.key}: {why}")
        if not shape.plain_accumulation:
            raise LayoutError(
                "step",
                f"with {self.key} the window runs as step=accumulate's; "
                f"{type(shape.step).__name__} needs the whole model on one rank",
            )
        callbacks = shape.callbacks
        for name, cb in (callbacks.named if callbacks is not None else {}).items():
            if cb.per_micro_batch or name in callbacks.averaged_weights():
                raise LayoutError(
                    f"callbacks.{name}",
                    f"not available with {self.key}: it looks at every micro-batch's gradients "
                    "or keeps a copy of every weight, which no rank holds whole",
                )

    def clip_(self, params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
        clip_local_(params, max_norm, norm)

    def agree_found_inf(self, precision: Precision, optimizer: torch.optim.Optimizer) -> None:
        agree_found_inf(precision, optimizer)


def clip_local_(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Clip to `norm`, the total over ranks holding different parameters: the gradients may
    mix DTensor shards and whole tensors, so each rank scales its own values in place."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([local_values(p.grad) for p in params if p.grad is not None], coef)


def agree_found_inf(precision: Precision, optimizer: torch.optim.Optimizer) -> None:
    """fp16: an overflow on any rank skips every rank's step (ranks hold different
    parameters, so their GradScalers would decide apart)."""
    import torch.distributed as dist

    for flag in precision.found_inf_flags(optimizer):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)


def micro_backward(
    ctx: WindowContext, batch: Batch, count: torch.Tensor, synced: bool = False
) -> torch.Tensor:
    """Forward + backward of one micro-batch, scaled by the window's global `count` (clamped
    to at least 1: an all-padding window); returns its loss sum, detached (the graph goes
    with this frame). `synced`: its gradients are communicated inside backward (the wait is
    timed as `sync`). A count still pending (`SettlesCount`) is settled between the forward
    and the backward."""
    with ctx.precision.autocast():  # a task's item sums (DPO's rewards) go to the step's
        micro_sum = task_loss(ctx.task, ctx.model, batch, ctx.item_sums)
    # Scale in the loss's own precision (at least fp32): float64 runs stay float64.
    micro_sum = micro_sum.float() if micro_sum.dtype in _HALF else micro_sum
    if isinstance(ctx.parallel, SettlesCount):
        with ctx.clock.collective("window item count"):
            ctx.parallel.settle_count()
    if synced:
        ctx.clock.wait_after_backward(micro_sum)
    scale = ctx.grad_sync_divisor / count.clamp(min=1).to(micro_sum.dtype)
    ctx.precision.backward(micro_sum * scale)
    if synced:
        ctx.clock.after_backward()
    # A copy: under CUDA graphs (train.compile_mode=reduce-overhead) the loss lives in the
    # graph's static memory, which the next micro-batch's replay overwrites.
    return micro_sum.detach().clone()


def squares_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all `tensors` together (a DTensor for sharded ones). Squares summed in
    float64: finite gradients up to ~1e150 never overflow to an inf norm (fp32 overflows from
    ~1e19), so "inf norm" means a gradient really is non-finite."""
    per_tensor = torch._foreach_norm(list(tensors), 2.0, dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack(per_tensor)).float()


def total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all `tensors` together, on the device, the same on every rank (a sharded
    DTensor's norm is gathered)."""
    return whole_tensor(squares_norm(tensors))


def local_values(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of a DTensor (a view: in-place changes reach the DTensor), or the
    tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor, the same on every rank (collective over its mesh), or
    the tensor itself."""
    return t.full_tensor() if is_dtensor(t) else t


def is_dtensor(t: Any) -> bool:
    """A DTensor, without importing DTensor (slow to import) where none can exist yet."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def all_reduce_flat(tensors: list[torch.Tensor], group: ProcessGroup | None) -> None:
    """Sum `tensors` over `group` in place, one collective per dtype."""
    import torch.distributed as dist

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
