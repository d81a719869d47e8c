"""Expert parallelism (`dist.ep`): a mixture's experts split over `ep` ranks carved from the
data-parallel ranks, tokens sent to the rank holding their expert and back (all-to-all).

The data-parallel ranks 0..dp-1 form dp/ep expert groups of `ep` consecutive ranks; rank
`r` holds experts [e*E/ep, (e+1)*E/ep) of every mixture, e = r mod ep (its expert rank), and
shares them with the dp/ep ranks of the same expert rank (its replicas). Every other
parameter is laid out by the run's strategy, which reduces it and leaves the experts out:
replicated under DDP (`ExpertParallel`), or sharded over the dp ranks by FSDP2
(`ExpertShardedParallel`: `ignored_params`, so FSDP2 neither shards, casts nor reduces the
experts). The experts' gradients are summed over their replicas after the window and divided
as the strategy divides the others (`sync_divisor`: dp under DDP, whose backward the step
multiplies by dp, engine/steps/accumulate.py; 1 under FSDP2's sums), so the update is the
unsplit model's. The total gradient norm counts each parameter once: the squares of this
rank's experts summed over its expert group, plus the others' (FSDP2's shards summed over
their mesh). Under FSDP2's bf16 (`param_dtype`) the experts compute with their weights cast
to it, as FSDP2 casts the weights it shards. `ExpertSplit` is the expert side both share.

Checkpoints hold every expert as the unsplit model names it: DCP shards by default (this
rank's experts a DTensor slice, Shard(0) over the ep ranks, of the whole expert tensors), or
with checkpoint.format=full every expert gathered to rank 0; both resume under any dist.ep.

Expert parallelism applies from outside the experts, as torch's `distribute_module` applies
a layout: a model declares its mixtures (`HasExperts.expert_layers`: the experts' module,
the parameters holding every expert along dim 0, how the mixture calls it), and
`distribute_experts` keeps this rank's slice of those parameters (names unchanged) and wraps
the module's call: the tokens go to the ranks holding their experts (`ExpertGroup.run`:
split sizes exchanged first, the rows all-to-all with uneven splits, dropless, a rank may
receive none; regrouped by local expert), the module's own forward runs there on this rank's
experts, and the outputs come back the same way, the dispatch's state in the call's locals.
The experts' forward has no parallel branch. Autograd runs through `AllToAll`, whose
backward is the reverse all-to-all. Two calls are known (`ExpertCall`): rows sorted by
expert with their counts (`sorted_rows`: the in-tree GPT's experts, between
engine/moe/routing.py's `dispatch` and `combine`), and the router's choice (`top_k`:
transformers' experts, whose own forward runs on what arrives, each row routed to its local
expert with weight 1, and the outputs weighed and summed after they come back).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed import unwrap
from engine.moe.routing import dispatch
from engine.parallel import LayoutError
from engine.parallel.base import (
    ParallelBase,
    RunShape,
    agree_found_inf,
    clip_local_,
    is_dtensor,
    squares_norm,
    whole_tensor,
)
from engine.parallel.ddp import DataParallel, ignore_in_ddp
from engine.parallel.fsdp import FullyShardedDataParallel

if TYPE_CHECKING:
    from engine.numerics.precision import Precision


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; the gradient goes back the reverse way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertGroup:
    """This rank's place among the expert-parallel ranks: `size` ranks of `group` hold
    `local` experts each; this rank (`rank` in the group) holds [rank*local, (rank+1)*local).
    `param_dtype`: the dtype the experts compute in (FSDP2's, under dist.strategy=fsdp with
    bf16), None for their own."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        size: int,
        rank: int,
        local: int,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        self.group, self.size, self.rank, self.local = group, size, rank, local
        self.param_dtype = param_dtype

    def keep(self, p: nn.Parameter) -> nn.Parameter:
        """This rank's experts of `p` (every expert's, along dim 0): a parameter of their own
        that keeps `p`'s requires_grad (an adapter's frozen base stays frozen)."""
        first = self.rank * self.local
        return nn.Parameter(
            p.detach()[first : first + self.local].clone(), requires_grad=p.requires_grad
        )

    def run(
        self,
        xs: torch.Tensor,
        counts: Sequence[int],
        compute: Callable[[torch.Tensor, list[int]], torch.Tensor],
    ) -> torch.Tensor:
        """`xs` (N*k, C) sorted by global expert, `counts` rows per global expert -> the
        experts' outputs in the same order; `compute(rows, local_counts)` runs this rank's
        experts on rows sorted by local expert. The dispatch's state (split sizes, the
        regrouping) lives in this call's locals."""
        # (ep, local): rows for each rank's experts; exchanged so each rank knows what comes.
        send = torch.tensor(list(counts), dtype=torch.int64, device=xs.device)
        send = send.view(self.size, self.local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[src, j]: src's rows for j
        # The sizes are read to the host once: what this rank sends it knows already.
        counts = list(counts)
        in_splits = [sum(counts[r * self.local : (r + 1) * self.local]) for r in range(self.size)]
        received = recv.tolist()  # (ep, local)
        out_splits = [sum(row) for row in received]
        got = AllToAll.apply(xs, out_splits, in_splits, self.group)  # by source, then expert
        # Regroup by local expert (stable: each source's rows keep their order).
        local = torch.arange(self.local, device=xs.device).repeat(self.size)
        owner = torch.repeat_interleave(local, recv.reshape(-1))  # (rows,) each row's expert
        order = torch.argsort(owner, stable=True)
        ys = compute(got[order], [sum(column) for column in zip(*received)])
        back = torch.empty_like(ys).index_copy(0, order, ys)  # by source again
        return AllToAll.apply(back, in_splits, out_splits, self.group)


# ---- how a mixture calls its experts: the input and output functions of the split ----
# An `ExpertCall` is given the group, the experts' own forward (on this rank's experts) and
# the arguments of the mixture's call; it sends the tokens to the ranks holding their
# experts, runs the forward there and brings the outputs back (torch's `distribute_module`
# input_fn and output_fn in one function, so the dispatch's state stays in its locals).
ExpertCall = Callable[..., torch.Tensor]


def sorted_rows(
    group: ExpertGroup,
    forward: Callable[[torch.Tensor, list[int]], torch.Tensor],
    rows: torch.Tensor,
    counts: torch.Tensor | Sequence[int],
) -> torch.Tensor:
    """Experts called on `rows` (M, C) sorted by expert, `counts` (E,) rows per expert (the
    in-tree GPT's `Experts`, engine/moe/routing.py's `dispatch`) -> their outputs (M, C) in
    the same order; their forward runs on rows sorted by local expert, with local counts."""
    return group.run(rows, torch.as_tensor(counts).tolist(), forward)  # host split sizes


def top_k(
    group: ExpertGroup,
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Experts called with the router's choice, as transformers' `ExpertsInterface` calls
    them: `hidden_states` (N, C), `top_k_index` (N, k) global experts, `top_k_weights` (N, k)
    -> (N, C), each token's weighted sum over its experts. Their own forward runs on what
    this rank received, each row a token of its own routed to one local expert with weight 1
    (x * 1.0 is exact); the outputs come back and are weighed and summed here, each token's
    in expert order, as transformers' eager forward adds them."""
    xs, d = dispatch(hidden_states, top_k_index, group.size * group.local)  # by expert
    ones = functools.partial(_one_expert_each, forward, top_k_weights.dtype)
    ys = group.run(xs, d.counts.tolist(), ones)  # (N*k, C) in the hidden states' dtype
    w = top_k_weights.reshape(-1)[d.order].unsqueeze(-1)  # (N*k, 1)
    # The outputs hold values of the weights' dtype (the experts' and the router's products
    # alike): weighed in it, as transformers weighs them, then added in the hidden states'.
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, d.tokens, (ys.to(w.dtype) * w).to(out.dtype))


def _one_expert_each(
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
    rows: torch.Tensor,
    counts: list[int],
) -> torch.Tensor:
    """`forward` on `rows` sorted by local expert, `counts` each: each row routed to its
    expert alone (k=1) with weight 1."""
    experts = torch.arange(len(counts), device=rows.device)
    index = torch.repeat_interleave(experts, torch.tensor(counts, device=rows.device))
    if rows.shape[0] == 0:
        # Nothing came: a zero row through expert 0 keeps the experts and both all-to-alls in
        # the graph (every rank's backward runs the reverse exchanges; the gradient is 0).
        one = torch.ones(1, 1, dtype=dtype, device=rows.device)
        return forward(rows.sum(0, keepdim=True), index.new_zeros(1, 1), one)[:0]
    weights = torch.ones(index.shape[0], 1, dtype=dtype, device=rows.device)
    return forward(rows, index.unsqueeze(-1), weights)


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture's experts as expert parallelism splits them: `module` holds every expert
    of the `num_experts` along dim 0 of its own parameters `params` (any other parameter is
    shared by the experts and stays whole); `call` is how the mixture calls it
    (`sorted_rows`, `top_k`); `key` is the config key setting `num_experts`, named when
    dist.ep does not divide it (e.g. model.moe.experts, model.config.num_local_experts)."""

    module: nn.Module
    num_experts: int
    key: str
    call: ExpertCall
    params: tuple[str, ...]


@runtime_checkable
class HasExperts(Protocol):
    """A model whose mixtures expert parallelism can split: `expert_layers()` lists them
    (none in a dense model).

    Example::

        class MyMoE(nn.Module):
            def expert_layers(self) -> list[ExpertLayer]:
                return [
                    ExpertLayer(b.experts, 8, "model.experts", sorted_rows, ("w1", "w2"))
                    for b in self.blocks
                ]
    """

    def expert_layers(self) -> Sequence[ExpertLayer]: ...


def distribute_experts(layer: ExpertLayer, group: ExpertGroup) -> list[nn.Parameter]:
    """Expert parallelism applied to one mixture from outside, as torch's `distribute_module`
    applies a layout: each of `layer.params` replaced by this rank's experts (the names
    unchanged), and the module's call wrapped so that the tokens go to the ranks holding
    their experts before its own forward and come back after it (`layer.call`); its forward
    runs on this rank's experts, with their weights in `group.param_dtype` when it is set.
    The kept parameters."""
    module = layer.module
    kept = [group.keep(module.get_parameter(name)) for name in layer.params]
    for name, p in zip(layer.params, kept):
        module.register_parameter(name, p)
    own = module.forward
    dtype = group.param_dtype

    def forward(*args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        def local(*inputs: torch.Tensor) -> torch.Tensor:
            if dtype is None:
                return own(*inputs)
            cast = {name: module.get_parameter(name).to(dtype) for name in layer.params}
            with computing_with(module, cast):  # as FSDP2 casts the weights it shards
                return own(*(_cast(x, dtype) for x in inputs))

        return layer.call(group, local, *args, **kwargs)

    module.forward = forward
    return kept


def _cast(x: Any, dtype: torch.dtype) -> Any:
    """A floating-point tensor in `dtype`; anything else (indices, counts) as it is."""
    is_float = isinstance(x, torch.Tensor) and x.is_floating_point()
    return x.to(dtype) if is_float else x


@contextlib.contextmanager
def computing_with(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within: `module`'s own parameters of these names are `tensors` (torch.func's
    `functional_call` swaps them so, but calls the module, whose call this wraps)."""
    saved = {name: module._parameters[name] for name in tensors}
    module._parameters.update(tensors)  # type: ignore[arg-type]
    try:
        yield
    finally:
        module._parameters.update(saved)


def check_beside_experts(shape: RunShape) -> None:
    """Refuse (`LayoutError`) what does not compose with dist.ep > 1 yet, from the run's
    choices alone: an averaged copy of the weights, the automatic micro-batch, compilation,
    per-layer norms and any step but step=accumulate; one paragraph each, naming its key."""
    averaged = shape.callbacks.averaged_weights() if shape.callbacks is not None else {}
    for name in averaged:
        raise LayoutError(
            f"callbacks.{name}",
            "not available with dist.ep > 1 yet: it keeps an average of every weight, and "
            f"each rank holds only its own experts; remove callbacks.{name} or set dist.ep=1",
        )
    refused = {
        "train.micro_batch_size": (
            shape.auto_micro_batch,
            "auto is not probed with it yet; set a number (e.g. train.micro_batch_size=4)",
        ),
        "train.compile": (
            shape.compile,
            "compiling the all-to-all is not built yet; set train.compile=false",
        ),
        "train.grad_norms": (
            shape.per_layer_norms,
            "per-layer norms would see this rank's experts only; set train.grad_norms=total",
        ),
        "step": (
            not shape.plain_accumulation,
            f"{type(shape.step).__name__} is not built with it yet; use step=accumulate",
        ),
    }
    for key, (bad, why) in refused.items():
        if bad:
            raise LayoutError(key, f"not available with dist.ep > 1: {why}, or dist.ep=1")


class ExpertSplit(ParallelBase):
    """The expert side of expert parallelism, whatever holds the other parameters: the
    groups, the split, the experts' gradient sync and their part of the norm, the checkpoints
    of whole experts. Mixed in before `DataParallel` (`ExpertParallel`) or
    `FullyShardedDataParallel` (`ExpertShardedParallel`), whose methods it extends."""

    # Some parameters (the experts) differ between ranks and every forward is collective:
    # evaluation runs in lockstep, nothing runs the model on one rank alone.
    shards_parameters = True
    whole_model = False

    def __init__(self, info: Any, ep: int, mesh: Any = None) -> None:
        super().__init__(info, mesh)
        self.ep = ep
        rank = info.rank
        self.ep_rank = rank % ep
        self.expert_group: dist.ProcessGroup | None = None
        self.replica_group: dist.ProcessGroup | None = None
        world = info.world_size
        # Every rank creates every group, in the same order (new_group's contract).
        for first in range(0, world, ep):
            g = dist.new_group(list(range(first, first + ep)))
            if first <= rank < first + ep:
                self.expert_group = g
        for e in range(ep):
            g = dist.new_group(list(range(e, world, ep)))
            if e == self.ep_rank:
                self.replica_group = g
        self.expert_params: list[nn.Parameter] = []
        # (replicas, ep): the experts as DTensors in sharded checkpoints, Shard(0) over `ep`.
        from torch.distributed.device_mesh import init_device_mesh

        self.expert_mesh = init_device_mesh(
            info.device.type, (world // ep, ep), mesh_dim_names=("ep_replica", "ep")
        )

    def check(self, shape: RunShape) -> None:
        # Decided before any group too (ParallelDims.check, from the config); again here for
        # the step the task chose (trainer/run/extensions/window.py) and for the planner's
        # simulated run.
        check_beside_experts(shape)
        super().check(shape)

    @property
    def checkpoint_format(self) -> str:
        return "sharded"  # each expert written once, by a rank holding it (DCP)

    def describe(self) -> str:
        return f"experts split over {self.ep} ranks (dist.ep={self.ep})"

    def split_experts(
        self, model: nn.Module, param_dtype: torch.dtype | None = None
    ) -> set[nn.Parameter]:
        """Keep this rank's experts of every mixture of `model` (before any wrapper sees its
        parameters), computing in `param_dtype` if given; the kept parameters."""
        layers = list(model.expert_layers()) if isinstance(model, HasExperts) else []
        if not layers:
            raise LayoutError(
                "dist.ep",
                f"splits a mixture's experts over ranks, but {type(model).__name__} has no "
                "mixture-of-experts layer the split knows: the in-tree GPT's (model.moe.experts "
                "> 0), or a transformers mixture whose experts transformers declares "
                "(`use_experts_implementation`), as Qwen3-MoE's, Mixtral's and OLMoE's are "
                "(model=hf_qwen3_moe, model=hf_mixtral); set dist.ep=1 for a dense model",
            )
        for layer in layers:
            if layer.num_experts % self.ep:
                raise LayoutError(
                    "dist.ep",
                    f"must divide {layer.key} ({layer.num_experts}), got {self.ep}: each "
                    "expert-parallel rank holds the same number of experts",
                )
        assert self.expert_group is not None
        for layer in layers:
            local = layer.num_experts // self.ep
            group = ExpertGroup(self.expert_group, self.ep, self.ep_rank, local, param_dtype)
            self.expert_params.extend(distribute_experts(layer, group))
        return set(self.expert_params)

    def _is_expert(self) -> Callable[[nn.Parameter], bool]:
        owned = {id(p) for p in self.expert_params}
        return lambda p: id(p) in owned

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """The experts' gradients: summed over their replicas, divided as the wrapper divides
        the others (DDP by dp, FSDP2 not at all: `sync_divisor`)."""
        super().sync_gradients(params)
        is_expert = self._is_expert()
        grads = [p.grad for p in params if is_expert(p) and p.grad is not None]
        if not grads:
            return
        if self.dp_size > self.ep:
            works = [
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=self.replica_group, async_op=True)
                for g in grads
            ]
            for w in works:
                w.wait()
        if self.sync_divisor > 1:
            torch._foreach_div_(grads, float(self.sync_divisor))

    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """Each parameter once: the others' squares (FSDP2's shards summed over their mesh,
        replicated ones as they are) plus this rank's experts' squares summed over its expert
        group."""
        is_expert = self._is_expert()
        grads = [(p.grad, is_expert(p)) for p in params if p.grad is not None]
        if not grads:
            return super().grad_norm(params)  # its error
        sharded = [g for g, expert in grads if not expert and is_dtensor(g)]
        dense = [g for g, expert in grads if not expert and not is_dtensor(g)]
        experts = [g for g, expert in grads if expert]

        def squares(gs: list[torch.Tensor]) -> torch.Tensor:
            if not gs:
                return torch.zeros((), dtype=torch.float64, device=self.info.device)
            return whole_tensor(squares_norm(gs)).double().pow(2)

        expert_squares = squares(experts)
        dist.all_reduce(expert_squares, op=dist.ReduceOp.SUM, group=self.expert_group)
        return (squares(sharded) + squares(dense) + expert_squares).sqrt().float()

    def clip_(self, params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
        clip_local_(params, max_norm, norm)  # FSDP2's DTensor shards and the plain experts

    def agree_found_inf(self, precision: Precision, optimizer: torch.optim.Optimizer) -> None:
        agree_found_inf(precision, optimizer)  # one rank's expert overflow skips every rank

    # ---- checkpoints: whole experts, so any ep (or none) resumes them ----
    def _expert_names(self, model: nn.Module) -> dict[str, nn.Parameter]:
        is_expert = self._is_expert()
        return {n: p for n, p in unwrap(model).named_parameters() if is_expert(p)}

    def _whole(self, t: torch.Tensor) -> torch.Tensor | None:
        """This rank's experts' slice -> every expert's (dim 0) on rank 0 (None elsewhere),
        gathered over rank 0's expert group (ranks 0..ep-1; the others hold replicas)."""
        parts = [torch.empty_like(t) for _ in range(self.ep)] if self.info.rank == 0 else None
        dist.gather(t.contiguous(), parts, dst=0, group=self.expert_group)
        return torch.cat(parts).cpu() if parts is not None else None

    def _mine(self, t: torch.Tensor) -> torch.Tensor:
        """Every expert's value -> this rank's slice (dim 0)."""
        local = t.shape[0] // self.ep
        return t[self.ep_rank * local : (self.ep_rank + 1) * local]

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The unsplit model's state (every expert whole, with its optimizer state): resumes
        under any dist.ep, exports whole."""
        model_state, optimizer_state = super().full_state(model, optimizer, trainable_only)
        if self.info.rank >= self.ep:  # not in rank 0's expert group: only replicas here
            return model_state, optimizer_state
        for name, p in self._expert_names(model).items():  # collectives: in the same order
            whole = self._whole(p.detach())
            moments = {
                k: self._whole(v)
                for k, v in optimizer.state.get(p, {}).items()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            }
            if whole is not None:  # rank 0 receives the state
                model_state[name] = whole
                optimizer_state["state"].setdefault(name, {}).update(moments)
        return model_state, optimizer_state

    def _as_dtensors(self, model: nn.Module, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """In `state` ({"model": ..., "optimizer": flat}), each expert tensor of this rank
        replaced by a DTensor of every expert (Shard(0) over the ep ranks, replicated over
        the groups), aliasing the local tensor; returns the local tensors by key path."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        placements = [Replicate(), Shard(0)]
        local: dict[str, torch.Tensor] = {}

        def wrap(t: torch.Tensor) -> DTensor:
            shape = torch.Size((t.shape[0] * self.ep, *t.shape[1:]))
            stride = torch.empty(shape, device="meta").stride()
            return DTensor.from_local(
                t, self.expert_mesh, placements, run_check=False, shape=shape, stride=stride
            )

        names = self._expert_names(model)
        model_state = state.get("model", {})
        for name in names:
            if name in model_state:
                local[f"model.{name}"] = model_state[name]
                model_state[name] = wrap(model_state[name])
        flat = state.get("optimizer") or {}
        for key, value in list(flat.items()):
            parts = key.split(".")
            owner = ".".join(parts[1:-1])
            is_moment = isinstance(value, torch.Tensor) and value.dim() > 0
            if parts[0] == "state" and owner in names and is_moment:
                local[f"optimizer.{key}"] = value
                flat[key] = wrap(value)
        return local

    def sharded_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
    ) -> dict[str, Any]:
        """DDP's replicated tensors as they are, the experts as DTensors of every expert (DCP
        writes each expert once, and reshards them to any dist.ep on load)."""
        state = super().sharded_state(model, optimizer, trainable_only)
        self._as_dtensors(model, state)
        return state

    def load_sharded_state(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        trainable_only: bool = False,
    ) -> None:
        from engine.checkpoint.sharded import load_sharded

        def lay_out(state: dict[str, Any]) -> Callable[[], None]:
            local = self._as_dtensors(model, state)

            def put_back() -> None:  # the DTensors read in place: their local tensors
                for key, t in local.items():
                    where, name = key.split(".", 1)
                    state[where][name] = t

            return put_back

        with self.optimizer_context():  # loading initializes the optimizer's state
            load_sharded(path, model, optimizer, extra, trainable_only, lay_out=lay_out)

    def load_full_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any] | None,
        trainable_only: bool = False,
    ) -> None:
        names = self._expert_names(model)
        model_state = {k: self._mine(v) if k in names else v for k, v in model_state.items()}
        if optimizer_state is not None:
            state = {
                k: {
                    key: self._mine(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                    for key, v in moments.items()
                }
                if k in names
                else moments
                for k, moments in optimizer_state.get("state", {}).items()
            }
            optimizer_state = {**optimizer_state, "state": state}
        super().load_full_state(model, optimizer, model_state, optimizer_state, trainable_only)


class ExpertParallel(ExpertSplit, DataParallel):
    """DDP for the replicated parameters, the experts split over `ep` ranks (module
    docstring)."""

    name = "ddp"

    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        del blocks, param_dtype, reshard_after_forward
        owned = {id(p) for p in self.split_experts(model)}
        names = [n for n, p in model.named_parameters() if id(p) in owned]
        ignore_in_ddp(model, names)
        return super().apply(model)

    def reduce_guarded_window(self, params: list[nn.Parameter]) -> None:
        # The replicated parameters only: `sync_gradients` reduces the experts after every
        # window, guarded or not (it ran here too, which would have summed them twice).
        is_expert = self._is_expert()
        super().reduce_guarded_window([p for p in params if not is_expert(p)])


class ExpertShardedParallel(ExpertSplit, FullyShardedDataParallel):
    """FSDP2 for the other parameters (each block and the root sharded over the dp ranks,
    gradients reduce-scattered as sums), the experts split over `ep` ranks and left out of
    FSDP2 (`ignored_params`): whole on each rank of their replica group, kept in the model's
    dtype and computing in FSDP2's `param_dtype`, their gradients summed over the replicas
    after the window (module docstring)."""

    name = "fsdp"

    def describe(self) -> str:
        return f"{super().describe()}, the other parameters sharded by FSDP2"

    def apply(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] = (),
        *,
        param_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
    ) -> nn.Module:
        experts = self.split_experts(model, param_dtype)  # they compute as FSDP2's would
        return self.shard(model, blocks, param_dtype, reshard_after_forward, whole=experts)

    def optimizer_context(self) -> contextlib.AbstractContextManager:
        """Around the optimizer's step, GradScaler's unscale and optimizer state loads: the
        experts are plain tensors next to FSDP2's DTensor shards in one optimizer, taken as
        replicated (each of those operations works parameter by parameter)."""
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()
