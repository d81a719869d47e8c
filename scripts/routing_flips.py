"""Why a mixture of experts' trajectory depends on the split over a long horizon: top-k
routing turns float rounding into a different expert choice.

    python scripts/routing_flips.py [--balance global] [--steps 60] [--splits 16x1 4x4]
                                    [--experts 8] [--top-k 2] [--no-pinned] [--threads 1]

Trains gpt_tiny (`--experts` experts, top-k; `--experts 0`: the dense model) in this process
on the default data, the same global batch cut as micro x accumulation per `--splits` (A,
then B), and records at every optimizer step:

- the top-k set each router chose for every position of the step's batch in the training
  forwards (`moe=global`'s routing pass, which runs without a graph and routes alike, is
  left out), and each position's margin: its k-th probability minus its (k+1)-th;
- the parameters after the step.

Then, unless `--no-pinned`, B again with every routing pinned to A's choices (the same
experts for every position, their weights B's own renormalized probabilities): the
counterfactual without routing flips.

It prints, per step, how many (layer, position) routings of B chose another top-k set than
A, the largest parameter difference (over the largest parameter) and the records' loss and
grad-norm differences, the same for pinned B; then the first step where a choice differs and
its margins. Within one step the split changes only the order of float sums (each step's
gradient is the whole batch's: tests/test_moe.py), so the runs' weights differ by rounding,
which training amplifies slowly (a dense model's too). A position whose margin falls below
that difference takes another expert in one run: from then on the runs' gradients differ by
a token's worth, not by rounding, and separate. Pinned, what is left is the rounding's own
amplification (a dense model's too).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import trainer.models.moe as in_tree_moe  # noqa: E402
from engine.callbacks.base import Callback  # noqa: E402
from engine.distributed import unwrap  # noqa: E402
from engine.moe.routing import HasRouters  # noqa: E402
from engine.step import StepContext  # noqa: E402


@dataclass
class StepRouting:
    """One optimizer step of one run: per router, the chosen top-k sets (N, k) sorted, and the
    margins (N,), over the step's whole batch in order; the parameters after the step."""

    experts: list[torch.Tensor]
    margins: list[torch.Tensor]
    params: torch.Tensor


@dataclass
class Recording:
    steps: list[StepRouting] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)  # each step's batch, in order


RECORDED: dict[str, Recording] = {}  # run name -> what its RoutingRecorder saw


@dataclass
class Pin:
    """Routes every forward as a recorded run did: the step, and the calls of top_k_route so
    far in this step, counted apart for forwards with and without a graph (moe=global's
    routing pass routes each micro-batch once more, without one)."""

    recording: Recording | None = None
    layers: int = 0
    step: int = 0
    calls: dict[bool, int] = field(default_factory=dict)


PIN = Pin()
_top_k_route = in_tree_moe.top_k_route


def pinned_route(
    logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_route with the experts of PIN.recording (the call's layer and micro-batch: the
    routers run in order in each forward, and micro-batches are consecutive rows)."""
    if PIN.recording is None:
        return _top_k_route(logits, top_k, bias)
    grad = torch.is_grad_enabled()
    call = PIN.calls.get(grad, 0)
    PIN.calls[grad] = call + 1
    layer, micro = call % PIN.layers, call // PIN.layers
    n = logits.shape[0]
    experts = PIN.recording.steps[PIN.step].experts[layer][micro * n : (micro + 1) * n]
    probs = torch.softmax(logits, dim=-1)
    weights = probs.gather(-1, experts)
    return weights / weights.sum(dim=-1, keepdim=True), experts


class RoutingRecorder(Callback):
    """Keeps every training forward's routing and the parameters after each step, into
    RECORDED[name] (the runs are trained in this process)."""

    def __init__(self, name: str) -> None:
        self.recording = RECORDED.setdefault(name, Recording())
        self.pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.batch: list[torch.Tensor] = []

    def setup(self, ctx: StepContext) -> None:
        model = unwrap(ctx.model)
        routers = model.routers() if isinstance(model, HasRouters) else []
        PIN.layers = len(routers)
        for index, router in enumerate(routers):
            router.register_forward_hook(self._hook(index))

    def _hook(self, index: int) -> Any:
        def record(module: Any, args: Any, output: Any) -> None:
            del args, output
            if not torch.is_grad_enabled():  # moe=global's routing pass: the same routing
                return
            logits = module.routing.logits.detach().double()  # (N, E)
            top = torch.topk(torch.softmax(logits, dim=-1), module.top_k + 1, dim=-1).values
            chosen = module.routing.experts.detach().sort(dim=-1).values  # (N, k)
            self.pending.setdefault(index, []).append((chosen, top[:, -2] - top[:, -1]))

        return record

    def on_after_micro_batch(
        self, ctx: StepContext, batch: Any, global_count: torch.Tensor, last: bool
    ) -> None:
        del ctx, global_count, last
        self.batch.append(batch[0].detach().clone())

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        params = torch.cat([p.detach().flatten() for p in unwrap(ctx.model).parameters()])
        layers = [self.pending[i] for i in sorted(self.pending)]
        self.recording.steps.append(
            StepRouting(
                [torch.cat([c for c, _ in calls]) for calls in layers],
                [torch.cat([m for _, m in calls]) for calls in layers],
                params.clone(),
            )
        )
        self.recording.inputs.append(torch.cat(self.batch))
        self.pending, self.batch = {}, []
        PIN.step, PIN.calls = step, {}


def train_split(name: str, split: str, args: argparse.Namespace) -> list[dict]:
    """One in-process run of `split` (MICROxACCUM), recorded as RECORDED[name]."""
    from trainer.api import train

    micro, accum = (int(x) for x in split.split("x"))
    model = ["model=gpt_tiny"]
    if args.experts:
        model += [f"+model.moe.experts={args.experts}", f"+model.moe.top_k={args.top_k}"]
    overrides = [
        *model,
        f"moe={args.balance}",
        "logger=none",
        f"train.micro_batch_size={micro}",
        f"train.grad_accum_steps={accum}",
        f"train.max_steps={args.steps}",
        "train.log_every=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "task.check_sum=false",  # its start-up forwards would count as step 1's routing
        f"+callbacks.routing={{_target_: {__name__}.RoutingRecorder, name: {name}}}",
    ]
    with tempfile.TemporaryDirectory() as run_dir:
        records = train(overrides, run_dir=run_dir)
    return [r for r in records if "train/loss" in r]


@dataclass
class Row:
    step: int
    flips: int
    dparam: float
    dloss: float
    dnorm: float


def differences(a: Recording, b: Recording, ra: list[dict], rb: list[dict]) -> list[Row]:
    """Per step: B's routings unlike A's, and how far apart their parameters and records are."""
    assert all(torch.equal(x, y) for x, y in zip(a.inputs, b.inputs)), "the batches differ"
    scale = a.steps[0].params.abs().max().item()
    rows = []
    for s, (x, y) in enumerate(zip(a.steps, b.steps)):
        flips = sum(int((ex != ey).any(-1).sum()) for ex, ey in zip(x.experts, y.experts))
        rows.append(
            Row(
                s + 1,
                flips,
                (x.params - y.params).abs().max().item() / scale,
                abs(ra[s]["train/loss"] - rb[s]["train/loss"]),
                abs(ra[s]["train/grad_norm"] - rb[s]["train/grad_norm"]),
            )
        )
    return rows


def report(names: list[str], free: list[Row], pinned: list[Row] | None) -> None:
    a, b = (RECORDED[n] for n in names)
    positions = sum(e.shape[0] for e in a.steps[0].experts)
    first = next((r.step for r in free if r.flips), None)
    print(f"\n{names[0]} vs {names[1]}: {len(free)} steps, {positions} (layer, position) routings")
    head = "step  routings differing  max|d param|/max|param|  |d loss|  |d grad norm|"
    print(head + ("  | pinned: d param  d loss    d grad norm" if pinned else ""))
    shown = {1, 2, 3, len(free)} | set(range(10, len(free) + 1, 10))
    if first is not None:
        shown |= set(range(max(1, first - 3), first + 4))
    for i, r in enumerate(free):
        if r.step not in shown:
            continue
        line = f"{r.step:4d}  {r.flips:18d}  {r.dparam:23.2e}  {r.dloss:8.2e}  {r.dnorm:12.2e}"
        if pinned:
            p = pinned[i]
            line += f"  |         {p.dparam:.2e}  {p.dloss:.2e}  {p.dnorm:.2e}"
        print(line)
    if first is None:
        top = max(r.dparam for r in free)
        loss, norm = max(r.dloss for r in free), max(r.dnorm for r in free)
        print(
            f"no routing differs in {len(free)} steps; parameters within {top:.1e} relative, "
            f"|d loss| <= {loss:.1e}, |d grad norm| <= {norm:.1e}"
        )
        return
    before = free[first - 2].dparam if first > 1 else 0.0
    print(
        f"first routing unlike {names[0]}'s at step {first}: its forward runs on the weights "
        f"after step {first - 1}, {before:.1e} relative apart"
    )
    s = first - 1
    for layer, (ex, ey) in enumerate(zip(a.steps[s].experts, b.steps[s].experts)):
        for pos in (ex != ey).any(-1).nonzero().flatten().tolist():
            ma, mb = a.steps[s].margins[layer][pos].item(), b.steps[s].margins[layer][pos].item()
            print(
                f"  router {layer}, position {pos}: experts {ex[pos].tolist()} vs "
                f"{ey[pos].tolist()}; k-th minus (k+1)-th probability {ma:.1e} vs {mb:.1e}"
            )
    print(f"at step {len(free)}: parameters {free[-1].dparam:.1e} relative apart", end="")
    print(f"; pinned to {names[0]}'s routing {pinned[-1].dparam:.1e}" if pinned else "")
    spans = [(f"steps 1-{first - 1}", free[: first - 1]), (f"steps {first}-", free[first - 1 :])]
    spans += [("pinned, every step", pinned)] if pinned else []
    for label, rows in spans:
        if rows:
            loss, norm = max(r.dloss for r in rows), max(r.dnorm for r in rows)
            print(f"  {label}: |d loss| <= {loss:.1e}, |d grad norm| <= {norm:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--balance", default="global", help="moe.balance (global, none, ...)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--splits", nargs=2, default=["16x1", "4x4"], help="micro x accum")
    parser.add_argument("--experts", type=int, default=8, help="0: the dense gpt_tiny")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--no-pinned", action="store_true", help="skip the pinned run")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = list(args.splits)
    records = [train_split(name, name, args) for name in names]
    free = differences(*(RECORDED[n] for n in names), *records)
    pinned = None
    if args.experts and not args.no_pinned:
        in_tree_moe.top_k_route = pinned_route  # the in-tree Router's top-k, pinned to A's
        PIN.recording, PIN.step, PIN.calls = RECORDED[names[0]], 0, {}
        try:
            records.append(train_split("pinned", names[1], args))
        finally:
            in_tree_moe.top_k_route, PIN.recording = _top_k_route, None
        pinned = differences(RECORDED[names[0]], RECORDED["pinned"], records[0], records[2])
    report(names, free, pinned)


if __name__ == "__main__":
    main()
