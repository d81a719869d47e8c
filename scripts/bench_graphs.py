"""What torch.compile makes of a compiled cumulus run: graphs, breaks, and where each ends.

    python scripts/bench_graphs.py [--backend inductor|eager] [hydra overrides...]

Trains in this process with `train.compile=true` (default overrides: gpt_tiny, 3 steps of
micro 4 x accumulation 2, evaluation after step 3) and prints dynamo's counters: frames
compiled, graphs, graph breaks with their reasons, operations captured; and per graph its
number of operations and the shape of what it returns (a scalar: the loss is inside the
graph; (B, T, V): the graph ends at the logits and the loss runs eagerly). Each graph is
recorded on its way to inductor (`--backend eager`: run as traced, seconds instead of a
minute of compiling). The last line is the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch._inductor.compile_fx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.api import train  # noqa: E402

DEFAULTS = [
    "model=gpt_tiny",
    "logger=none",
    "train.max_steps=3",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    "train.log_every=1",
    "eval.every_steps=3",
    "eval.max_batches=1",
    "eval.sample_tokens=0",
    "checkpoint.every_steps=0",
    "task.check_sum=false",  # its eager forwards are not the step's
]


def record_graphs(backend: str) -> list[dict[str, Any]]:
    """Record every graph dynamo hands its backend: operations and the output's shapes."""
    graphs: list[dict[str, Any]] = []
    compile_fx = torch._inductor.compile_fx.compile_fx

    def recorded(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        (outputs,) = next(n for n in gm.graph.nodes if n.op == "output").args
        shapes = [
            [d if isinstance(d, int) else str(d) for d in o.meta["example_value"].shape]
            for o in torch.fx.node.map_arg(outputs, lambda n: n)
            if isinstance(o, torch.fx.Node) and "example_value" in o.meta
        ]
        last = getattr(ops[-1].target, "__name__", str(ops[-1].target)) if ops else ""
        graphs.append(
            {"grad": torch.is_grad_enabled(), "ops": len(ops), "returns": shapes, "last_op": last}
        )
        if backend == "eager":
            return gm.forward
        return compile_fx(gm, example_inputs, **kwargs)

    torch._inductor.compile_fx.compile_fx = recorded  # the inductor backend imports it per call
    return graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    args, overrides = ap.parse_known_args()
    graphs = record_graphs(args.backend)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        train([*DEFAULTS, *overrides, "train.compile=true"], run_dir=Path(tmp) / "run")
    seconds = time.perf_counter() - started
    breaks = {str(reason): n for reason, n in counters["graph_break"].items()}
    result = {
        "overrides": overrides,
        "backend": args.backend,
        "frames": dict(counters["frames"]),
        "graphs": graphs,
        "graph_breaks": breaks,
        "calls_captured": counters["stats"]["calls_captured"],
        "seconds": round(seconds, 1),
    }
    print(f"frames compiled: {result['frames']}; graphs: {len(graphs)}; breaks: {len(breaks)}")
    for i, g in enumerate(graphs):
        what = "training" if g["grad"] else "no_grad (evaluation)"
        print(
            f"  graph {i}, {what}: {g['ops']} ops, returns {g['returns']}, last op {g['last_op']}"
        )
    for reason, n in breaks.items():
        print(f"  break x{n}: {reason}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
