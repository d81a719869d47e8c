"""`PipelineParallel`: the stages over the mesh's `pp` ranks, the window run as the schedule's
actions, gradients summed over data-parallel ranks and shared stages, checkpoints gathered."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engine.distributed import DistInfo
from engine.item_sums import task_loss
from engine.numerics.chunked_ce import OutputHead
from engine.parallel.base import (
    NO_GUARD,
    LayoutError,
    MeshSplit,
    RunShape,
    WindowGuard,
    all_reduce_flat,
    local_values,
)
from engine.parallel.fsdp import shard_units
from engine.parallel.pipeline.links import Links, RecordedLinks
from engine.parallel.pipeline.schedule import Action, actions
from engine.parallel.pipeline.stages import (
    DeclaresStages,
    Forwarded,
    NotSplittable,
    call_for,
    prune,
    stage_ranges,
)
from engine.parallel.pipeline.state import (
    laid_out_like,
    load_named_optimizer_state,
    merge_states,
    named_optimizer_state,
    on_cpu,
)
from engine.parallel.tensor import check_dp_placements, dp_placement, sharded_squares


class PipelineParallel(MeshSplit):
    """`dist.pp` pipeline stages (times `dist.pp_virtual` per rank) over the mesh's `pp`
    dimension, data parallelism over its `dp` dimension.

    Gradients are summed over the data-parallel ranks after the window (no wrapper divides:
    `sync_divisor` is 1). Checkpoints hold the whole model under its own parameter names,
    gathered from the stages (`full`) or written by each stage for its own parameters
    (`sharded`: a parameter held by several stages, a tied embedding, has the same value and
    key on each and is written once), so a pipelined run resumes without a pipeline and the
    reverse. `checkpoint.format=auto` is `sharded` when the stages are FSDP-sharded, as
    under FSDP alone.
    """

    name = "pp"
    key = "dist.pp"
    # With `fsdp`, each stage is FSDP2-sharded over the data-parallel ranks (an instance
    # attribute then); forwards of a stage run in lockstep over its dp ranks anyway.
    shards_parameters = False

    def __init__(
        self,
        info: DistInfo,
        mesh: DeviceMesh,
        schedule: str = "1f1b",
        virtual: int = 1,
        split: Sequence[int] | None = None,
        fsdp: bool = False,
    ) -> None:
        super().__init__(info, mesh)
        self.fsdp = fsdp
        self.pp = mesh["pp"].size()
        self.pp_rank = mesh.get_local_rank("pp")
        # With a `tp` dimension (3-D: pp x dp x tp), each stage's linear layers are split over
        # the tensor-parallel ranks (engine/parallel/tensor.py), and a stage's activations go
        # to the rank of the next stage with the same dp and tp coordinates.
        names = mesh.mesh_dim_names or ()
        self.tensor = None
        if "tp" in names:
            from engine.parallel.tensor import TensorParallel

            self.tensor = TensorParallel(info, mesh)
        self.tp_rank = self.tensor.tp_rank if self.tensor is not None else 0
        self.schedule, self.virtual, self.split = schedule, virtual, split
        self.n_stages = self.pp * virtual
        self.stages: dict[int, nn.Module] = {}  # this rank's stages by global index
        self.head: nn.Module | None = None
        self.names: dict[int, str] = {}  # id(parameter) -> its name in the whole model
        self.shared: list[tuple[str, torch.Size, torch.dtype]] = []  # on several stages
        self.links = Links(self.rank_of_stage, self.n_stages, info.device)
        self.ranges: list[range] = []
        self.bubble = [0.0, 0.0]  # seconds blocked in receives, seconds of schedule, since read

    @property
    def checkpoint_format(self) -> str:
        # Not with tensor parallelism: DCP cannot save its strided q/k/v shards.
        return "sharded" if self.fsdp and self.tensor is None else "full"

    # ---- coordinates ----------------------------------------------------------------------
    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    def rank_of_stage(self, stage: int) -> int:
        """The global rank holding `stage` in this rank's data-parallel replica (and at this
        rank's tensor-parallel coordinate)."""
        if self.tensor is not None:
            return int(self.mesh.mesh[stage % self.pp, self.dp_rank, self.tp_rank])
        return int(self.mesh.mesh[stage % self.pp, self.dp_rank])

    @property
    def reports(self) -> bool:
        """Whether this rank's loss and evaluation sums count: the ranks of a tensor-parallel
        group compute the same ones, the first reports."""
        return self.tp_rank == 0

    def simulate_world(self, book: dict[Any, Any]) -> None:
        """trainer.plan: stage boundaries exchange nothing; receives return empty tensors
        shaped as the simulated peers recorded them."""
        super().simulate_world(book)
        self.links = RecordedLinks(book, self.n_stages, self.info.device)

    def optimizer_context(self) -> contextlib.AbstractContextManager:
        """With tensor parallelism: DTensor shards beside whole parameters in one optimizer."""
        if self.tensor is None:
            return contextlib.nullcontext()
        return self.tensor.optimizer_context()

    def describe(self) -> str:
        tensor = f" | {self.tensor.describe()}" if self.tensor is not None else ""
        return f"pipeline {self.pp} stages, {self.schedule}{tensor}"

    def check(self, shape: RunShape) -> None:
        super().check(shape)
        if self.schedule == "interleaved_1f1b" and shape.accum % self.pp:
            raise LayoutError(
                "train.grad_accum_steps",
                f"dist.pp_schedule=interleaved_1f1b sends micro-batches through the stages in "
                f"groups of dist.pp={self.pp}: the micro-batches per step must be a multiple of "
                f"it, got {shape.accum}",
            )
        if self.tensor is not None:
            self.tensor.check(shape)

    def is_last(self, stage: int) -> bool:
        return stage == self.n_stages - 1

    # ---- building -------------------------------------------------------------------------
    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        """Cut `model` into stages, keep this rank's, and prune `model` to their parameters;
        returns `model` (the holder the optimizer and checkpoints see)."""
        if not isinstance(model, DeclaresStages):
            raise NotSplittable(
                f"{type(model).__name__} does not declare how to split it into pipeline stages: "
                "it needs a method pipeline_stage(blocks, first, last) returning a module that "
                "runs those blocks and shares the model's parameters (docs/your-model.md, "
                "'Pipeline stages'); or run without dist.pp"
            )
        if not blocks:
            raise NotSplittable(
                f"{type(model).__name__} declares no blocks (block_modules()) to split into "
                "pipeline stages"
            )
        if self.tensor is not None:  # split the layers first: the stages share them
            self.tensor.apply(model)
        self.head = model.output_head() if isinstance(model, OutputHead) else None
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        self.ranges = stage_ranges(sizes, self.n_stages, self.split)
        if self.simulated is not None:  # no peer answers: every rank's names, from here
            self._names_by_rank = self._stage_names(model)
            self._shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
        for s in range(self.pp_rank, self.n_stages, self.pp):
            stage = model.pipeline_stage(list(self.ranges[s]), s == 0, self.is_last(s))
            if not isinstance(stage, nn.Module):
                raise NotSplittable(
                    f"{type(model).__name__}.pipeline_stage returned a {type(stage).__name__}; "
                    "it must return an nn.Module"
                )
            self.stages[s] = stage
        if self.fsdp:
            local = [blocks[i] for s in self.stages for i in self.ranges[s]]
            self._shard(local, param_dtype, reshard_after_forward)
        # After sharding: FSDP swaps in new parameters on the stages' modules only.
        prune(model, self.stages.values())
        self.names = {id(p): n for n, p in model.named_parameters()}
        self._find_shared(model)
        return model

    def _shard(
        self, blocks: list[nn.Module], param_dtype: torch.dtype | None, reshard: bool
    ) -> None:
        """FSDP2 over the `dp` ranks: each local block, then each stage as its root (the
        stage's own modules: embeddings, final norm, output layer). Sums, no division, as
        `FullyShardedDataParallel` does."""
        for stage in self.stages.values():
            check_dp_placements(stage, self.dp_size)
        units = [*blocks, *self.stages.values()]
        # dp_placement: a tensor-parallel q/k/v split is sharded on dim 1.
        shard_units(units, self.mesh["dp"], param_dtype, reshard, dp_placement)
        self.shards_parameters = True

    def _stage_names(self, model: nn.Module) -> list[list[str]]:
        """The trained parameter names of every pipeline rank's stages (a simulated world)."""
        names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        out = []
        for rank in range(self.pp):
            held: set[str] = set()
            for s in range(rank, self.n_stages, self.pp):
                stage = model.pipeline_stage(list(self.ranges[s]), s == 0, self.is_last(s))
                held |= {names[id(p)] for p in stage.parameters() if id(p) in names}
            out.append(sorted(held))
        return out

    def _find_shared(self, model: nn.Module) -> None:
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        mine = {n: (local_values(p).shape, p.dtype) for n, p in trained}
        everyone: list[Any] = [None] * self.pp
        if self.simulated is not None:
            everyone = self._names_by_rank
        else:
            dist.all_gather_object(everyone, sorted(mine), group=self.pp_group)
        seen: dict[str, int] = {}
        for names in everyone:
            for n in names:
                seen[n] = seen.get(n, 0) + 1
        shared = sorted(n for n, c in seen.items() if c > 1)
        shapes: list[Any] = [{n: mine[n] for n in shared if n in mine}] * self.pp
        if self.simulated is None:
            dist.all_gather_object(shapes, shapes[0], group=self.pp_group)
        else:  # a peer's copy of a shared parameter, as this rank knew it whole
            shapes.append({n: s for n, s in self._shapes.items() if n in shared and n not in mine})
        known = {k: v for d in shapes for k, v in d.items()}
        self.shared = [(n, *known[n]) for n in shared]
        # A shared parameter's gradient norm counts on the lowest pipeline rank holding it.
        owner = {}
        for r, names in enumerate(everyone):
            for n in names:
                owner.setdefault(n, r)
        self.not_counted = {n for n in mine if owner[n] != self.pp_rank}

    def gradient_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        del model, enabled  # gradients are summed once, after the window (`sync_gradients`)
        return contextlib.nullcontext()

    # ---- the window -----------------------------------------------------------------------
    def backward_window(
        self,
        ctx: Any,
        window: Sequence[Any],
        count: torch.Tensor,
        guard: WindowGuard = NO_GUARD,
    ) -> torch.Tensor:
        """Forward and backward of the window's micro-batches through the pipeline, in the
        schedule's order; gradients are then summed over data-parallel ranks and shared
        stages. Returns this rank's loss sum (zero on ranks without the last stage). No
        per-micro-batch callbacks and no guard (`check` refuses both)."""
        del guard
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.info.device)
        if ctx.precision.scaler is not None:
            # fp16: stages before the last never scale a loss, yet unscale gradients scaled by
            # the last stage's scale; every stage's scaler starts (and, agreeing on overflows,
            # stays) at the same scale.
            ctx.precision.scaler.scale(loss_sum)
        for stage in self.stages.values():
            stage.train()
        started, self.links.waited = time.perf_counter(), 0.0
        todo = actions(self.schedule, self.pp, self.pp_rank, len(window), self.virtual)
        if self.fsdp:  # reduce-scatter in each stage's last backward only (FSDP's no_sync)
            for stage in self.stages.values():
                stage.set_requires_gradient_sync(False)
            last_backward = {a.stage: i for i, a in enumerate(todo) if a.kind == "B"}
        for i, a in enumerate(todo):
            if self.fsdp and a.kind == "B" and last_backward[a.stage] == i:
                self.stages[a.stage].set_requires_gradient_sync(True)
            what = "forward" if a.kind == "F" else "backward"
            with ctx.clock.span(f"micro-batch {a.micro + 1}/{len(window)} {what}"):
                if a.kind == "F":
                    micro_sum = self._forward(ctx, a, window[a.micro], count, inputs, outputs)
                    if micro_sum is not None:
                        loss_sum = loss_sum + micro_sum.to(loss_sum.dtype).detach()
                else:
                    self._backward(ctx, a, inputs, outputs)
        self.links.flush()
        self.bubble[0] += self.links.waited
        self.bubble[1] += time.perf_counter() - started
        with ctx.clock.collective("gradient sync after the window"):
            self.sync_gradients([p for p in ctx.model.parameters() if p.requires_grad])
        return loss_sum if self.reports else torch.zeros_like(loss_sum)

    def _forward(
        self,
        ctx: Any,
        a: Action,
        batch: Any,
        count: torch.Tensor,
        inputs: dict[tuple[int, int], torch.Tensor],
        outputs: dict[tuple[int, int], torch.Tensor],
    ) -> torch.Tensor | None:
        hidden = None
        if a.stage > 0:
            hidden = self.links.recv(a.stage - 1, a.stage, a.micro, backward=False)
            if hidden.is_floating_point():
                hidden.requires_grad_(True)
            inputs[a.stage, a.micro] = hidden
        last = self.is_last(a.stage)
        call = call_for(self.head)(self.stages[a.stage], hidden, last, self.head)
        try:
            with ctx.precision.autocast():
                out = task_loss(ctx.task, call, batch, ctx.item_sums)
        except Forwarded as fwd:
            self.links.send(fwd.output, a.stage + 1, a.micro, backward=False)
            outputs[a.stage, a.micro] = fwd.output
            return None
        micro_sum = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
        # The exact normalization: the window's global item count, counted before any forward.
        outputs[a.stage, a.micro] = micro_sum * (1.0 / count.clamp(min=1).to(micro_sum.dtype))
        return micro_sum

    def _backward(
        self,
        ctx: Any,
        a: Action,
        inputs: dict[tuple[int, int], torch.Tensor],
        outputs: dict[tuple[int, int], torch.Tensor],
    ) -> None:
        out = outputs.pop((a.stage, a.micro))
        if self.is_last(a.stage):
            ctx.precision.backward(out)  # GradScaler scales the loss here, once
        else:
            grad = self.links.recv(a.stage + 1, a.stage, a.micro, backward=True)
            torch.autograd.backward(out, grad)
        hidden = inputs.pop((a.stage, a.micro), None)
        if hidden is not None:
            grad_in = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
            self.links.send(grad_in, a.stage - 1, a.micro, backward=True)

    # ---- gradients ------------------------------------------------------------------------
    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """Sum gradients over the data-parallel ranks, then over the stages that share a
        parameter (a tied embedding): afterwards every copy holds the whole gradient."""
        grads = [local_values(p.grad) for p in params if p.grad is not None]
        if self.dp_size > 1 and grads and not self.fsdp:  # FSDP reduce-scattered already
            all_reduce_flat(grads, self.dp_group)
        if self.shared:
            by_name = {self.names[id(p)]: p for p in params}
            flat = []
            for name, shape, dtype in self.shared:
                p = by_name.get(name)
                if p is not None and p.grad is None:
                    p.grad = torch.zeros_like(p)
                flat.append(
                    local_values(p.grad)
                    if p is not None
                    else torch.zeros(shape, dtype=dtype, device=self.info.device)
                )
            all_reduce_flat(flat, self.pp_group)

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The total gradient norm over every stage (each shared parameter counted once), the
        same on every rank; float64 squares, like the single-process norm."""
        # Squares summed over the mesh dimensions each gradient is sharded along (dp under
        # FSDP, tp for a split layer), then over the stages.
        grads = [
            p.grad
            for p in params
            if p.grad is not None and self.names.get(id(p)) not in self.not_counted
        ]
        sq = sharded_squares(grads, self.mesh, self.info.device)
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.pp_group)
        return sq.sqrt().float()

    def metrics(self, peak_mb: float) -> dict[str, float]:
        """Per pipeline rank since the last call (collective over the pipeline ranks):
        `train/pp_bubble/stageK`, the fraction of the schedule's time rank K spent blocked
        waiting for a neighbour (host time: exact on gloo; on CUDA a lower bound, the host
        does not wait for NCCL), their mean `train/pp_bubble`, and `train/pp_peak_mem_mb/
        stageK`: each rank's `peak_mb` (peak CUDA memory allocated, or peak resident memory on
        CPU)."""
        waited, total = self.bubble
        self.bubble = [0.0, 0.0]
        mine = torch.tensor([waited / total if total else 0.0, peak_mb], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(self.pp)]
        dist.all_gather(everyone, mine.to(self.info.device), group=self.pp_group)
        out: dict[str, float] = {}
        for k, t in enumerate(everyone):
            out[f"train/pp_bubble/stage{k}"], out[f"train/pp_peak_mem_mb/stage{k}"] = t.tolist()
        out["train/pp_bubble"] = sum(t[0].item() for t in everyone) / self.pp
        return out

    # ---- evaluation -----------------------------------------------------------------------
    def eval_sums(
        self,
        model: nn.Module,
        task: Any,
        batches: Iterable[Any],
        sums_of: Any,
        n_forwards: int | None = None,
    ) -> Iterator[tuple[Any, dict[str, torch.Tensor]]]:
        """Forward-only through the pipeline: for each batch, `(batch, the task's sums)` on the
        rank with the last stage (`sums_of(task, model, batch)`), nothing elsewhere. With
        `n_forwards` (FSDP stages: forwards are collective over the dp ranks) the first batch
        is run again until that many went through, and not yielded."""
        del model  # this rank's stages run
        batches = list(batches) if n_forwards else batches
        extra = [None] * max(0, (n_forwards or 0) - len(batches))  # type: ignore[arg-type]
        for micro, batch in enumerate(chain(batches, extra)):
            counted = batch is not None
            batch = batch if counted else batches[0]  # type: ignore[index]
            for s, stage in self.stages.items():
                hidden = None
                if s > 0:
                    hidden = self.links.recv(s - 1, s, micro, backward=False)
                call = call_for(self.head)(stage, hidden, self.is_last(s), self.head)
                try:
                    sums = sums_of(task, call, batch)
                except Forwarded as fwd:
                    self.links.send(fwd.output, s + 1, micro, backward=False)
                    continue
                if counted:
                    yield batch, sums
            self.links.flush()

    @contextlib.contextmanager
    def eval_mode(self, model: nn.Module) -> Iterator[None]:
        modes = {s: st.training for s, st in self.stages.items()}
        for st in self.stages.values():
            st.eval()
        try:
            with super().eval_mode(model):
                yield
        finally:
            for s, st in self.stages.items():
                st.train(modes[s])

    # ---- checkpoints ----------------------------------------------------------------------
    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The whole model's and optimizer's state under the model's parameter names, on rank
        0 (empty elsewhere), in the format of a single-process `full` checkpoint. Collective.
        (Checkpoints of trainable parameters alone, `trainable_only`, are not built for
        stages: adapters refuse dist.pp before anything is built.)"""
        assert not trainable_only, "trainable-only checkpoints are not built for dist.pp"
        local: Any = None
        # Every dp rank gathers (FSDP's shards are collective); the first one contributes.
        model_state = {k: on_cpu(v) for k, v in model.state_dict().items()}
        optimizer_state = named_optimizer_state(optimizer, self.names)
        if self.dp_rank == 0 and self.tp_rank == 0:
            local = (model_state, optimizer_state)
        everyone: list[Any] | None = [None] * self.info.world_size if self.info.is_main else None
        dist.gather_object(local, everyone, dst=0)
        if everyone is None:
            return {}, {}
        parts = [x for x in everyone if x is not None]
        return merge_states(parts)

    def load_full_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any] | None,
        trainable_only: bool = False,
    ) -> None:
        """Load a `full` checkpoint (saved with or without a pipeline) into this rank's stages:
        each takes its own parameters by name; anything of this rank missing is an error."""
        assert not trainable_only, "trainable-only checkpoints are not built for dist.pp"
        own = model.state_dict()
        missing = sorted(k for k in own if k not in model_state)
        if missing:
            raise KeyError(f"the checkpoint has no {', '.join(missing[:3])}")
        with self.optimizer_context():  # stages split over tensor-parallel ranks
            model.load_state_dict({k: laid_out_like(model_state[k], v) for k, v in own.items()})
            if optimizer is not None and optimizer_state is not None:
                load_named_optimizer_state(optimizer, self.names, optimizer_state)
