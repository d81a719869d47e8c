"""The documentation's pictures that are drawn from the code, not by hand, so they cannot lie:

- `docs/images/layout.svg`: which rank holds what in a world of `dp x pp x cp x tp` GPUs, from
  the mesh order `engine/parallel/dims.py` builds (`MESH_DIMS`: `pp` outermost, `tp`
  innermost, ranks row-major as `init_device_mesh` numbers them);
- `docs/images/plan.svg`: `python -m trainer.plan plan.search=true`'s ranking of layouts, as
  the planner wrote it to `plan.json`, for the planning guide.

    python scripts/docs_pictures.py [--out docs/images] [--skip-plan]

The plan picture runs the planner (about a minute on two CPU cores); the layout is instant.
tests/test_docs_site.py redraws the layout and checks that the committed file is the drawing.
"""

from __future__ import annotations

import argparse
import html
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engine.parallel.dims import MESH_DIMS  # noqa: E402

LAYOUT = {"pp": 2, "dp": 2, "cp": 2, "tp": 2}  # 16 GPUs: every dimension present
# A 1B Llama on 16 GPUs: the planner's search over DDP/FSDP, pp, tp, cp and checkpointing.
PLAN_COMMAND = [
    "model=hf_llama",
    "model.config.hidden_size=2048",
    "model.config.intermediate_size=8192",
    "model.config.num_hidden_layers=16",
    "model.config.num_attention_heads=32",
    "model.config.num_key_value_heads=8",
    "model.config.max_position_embeddings=4096",
    "data.block_size=4096",
    "train.precision=bf16",
    "train.micro_batch_size=1",
    "train.global_batch_size=64",
    "plan.world=16",
    "plan.gpu=h100",
    "plan.search=true",
]
PLAN_ROWS = 10
FONT = "font-family='ui-monospace, SFMono-Regular, Menlo, monospace'"
COLORS = ["#e8eaf6", "#fff3e0", "#e0f2f1", "#fce4ec"]  # one per data-parallel replica


def rank_grid(sizes: dict[str, int]) -> np.ndarray:
    """Rank ids indexed by (pp, dp, cp, tp): the row-major numbering of the mesh whose
    dimensions come in `MESH_DIMS` order."""
    shape = tuple(sizes[name] for name in MESH_DIMS)
    grid = np.arange(int(np.prod(shape))).reshape(shape)
    order = [MESH_DIMS.index(name) for name in ("pp", "dp", "cp", "tp")]
    return grid.transpose(order)


def layout_svg(sizes: dict[str, int]) -> str:
    """Stages left to right; in each, one row per data-parallel replica (its share of the
    global batch), and in a row the context chunks of a sequence, each split in tensor
    shards."""
    grid = rank_grid(sizes)
    pp, dp, cp, tp = grid.shape
    box_w, box_h, gap, pad = 100, 34, 8, 16
    cell_w = tp * box_w + (tp - 1) * 2
    row_w = cp * cell_w + (cp - 1) * gap
    stage_w = row_w + 2 * pad
    width = pp * stage_w + (pp - 1) * 24 + 40
    height = 70 + dp * (box_h + 30) + 40
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' {FONT} font-size='12'>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        f"<text x='20' y='22' font-size='14' font-weight='bold'>{pp * dp * cp * tp} GPUs: "
        f"dist.pp={pp} x dp {dp} x dist.cp={cp} x dist.tp={tp}</text>",
    ]
    for s in range(pp):
        x0 = 20 + s * (stage_w + 24)
        out.append(
            f"<rect x='{x0}' y='34' width='{stage_w}' height='{height - 60}' rx='8' "
            "fill='none' stroke='#3f51b5' stroke-dasharray='4 3'/>"
        )
        out.append(
            f"<text x='{x0 + pad}' y='52' fill='#3f51b5'>pipeline stage {s}: "
            f"1/{pp} of the blocks</text>"
        )
        for d in range(dp):
            y = 66 + d * (box_h + 30)
            out.append(f"<text x='{x0 + pad}' y='{y + 10}'>replica {d}: 1/{dp} of the batch</text>")
            for c in range(cp):
                for t in range(tp):
                    x = x0 + pad + c * (cell_w + gap) + t * (box_w + 2)
                    rank = int(grid[s, d, c, t])
                    out.append(
                        f"<rect x='{x}' y='{y + 16}' width='{box_w}' height='{box_h}' rx='4' "
                        f"fill='{COLORS[d % len(COLORS)]}' stroke='#555'/>"
                    )
                    out.append(
                        f"<text x='{x + 6}' y='{y + 30}' font-weight='bold'>rank {rank}</text>"
                    )
                    out.append(
                        f"<text x='{x + 6}' y='{y + 44}' font-size='10'>seq {c + 1}/{cp}, "
                        f"tp {t}</text>"
                    )
    out.append(
        f"<text x='20' y='{height - 12}' font-size='11' fill='#555'>neighbouring ranks share "
        "the most traffic: tp innermost, then cp, dp; pp outermost (engine/parallel/dims.py)"
        "</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def plan_svg(plan: dict, command: list[str]) -> str:
    """The search's ranking: the first `PLAN_ROWS` layouts as `trainer.plan` printed them."""
    rows = plan["layouts"][:PLAN_ROWS]
    head = ["#", "fits", "peak GiB", "step s", "how", "overrides"]
    lines = [head] + [
        [
            str(i + 1),
            "yes" if r["fits"] else "no",
            f"{r['peak_bytes'] / 2**30:.1f}",
            f"{r['step_time_s']:.2f}" if r.get("step_time_s") is not None else "-",
            r["how"],
            " ".join(o for o in r["overrides"] if not o.startswith("model.activation_c"))
            + (" ckpt" if "model.activation_checkpointing=true" in r["overrides"] else ""),
        ]
        for i, r in enumerate(rows)
    ]
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    char_w, line_h = 7.3, 20
    width = int(sum(widths) * char_w + len(widths) * 24 + 30)
    title = textwrap.wrap(f"python -m trainer.plan {' '.join(command)}", 130)
    top = 14 * len(title) + 30
    height = top + 24 + len(lines) * line_h + 30
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' {FONT} font-size='12'>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        *(
            f"<text x='12' y='{20 + 14 * i}' font-size='11' fill='#555'>{html.escape(t)}</text>"
            for i, t in enumerate(title)
        ),
        f"<text x='12' y='{top}' font-weight='bold'>{len(plan['layouts'])} layouts of "
        f"{plan['world']} x {plan['gpu']}, fastest fitting first</text>",
    ]
    for n, line in enumerate(lines):
        y = top + 24 + n * line_h
        if n == 0:
            out.append(
                f"<rect x='8' y='{y - 14}' width='{width - 16}' height='{line_h}' fill='#e8eaf6'/>"
            )
        elif line[1] == "no":
            out.append(
                f"<rect x='8' y='{y - 14}' width='{width - 16}' height='{line_h}' fill='#fce4ec'/>"
            )
        x = 14.0
        for c, text in enumerate(line):
            weight = " font-weight='bold'" if n == 0 else ""
            out.append(f"<text x='{x:.0f}' y='{y}'{weight}>{html.escape(text)}</text>")
            x += widths[c] * char_w + 24
    out.append(
        f"<text x='12' y='{height - 12}' font-size='11' fill='#555'>estimates, so labelled "
        "(docs/plan.md's assumptions); simulated: built and run on fake tensors</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def run_plan(command: list[str]) -> dict:
    """`trainer.plan` run as a user runs it; its plan.json."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        args = [sys.executable, "-m", "trainer.plan", *command, f"plan.out={out}"]
        subprocess.run(args, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--skip-plan", action="store_true", help="draw the layout only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layout.svg").write_text(layout_svg(LAYOUT))
    print(f"written: {args.out / 'layout.svg'}")
    if not args.skip_plan:
        (args.out / "plan.svg").write_text(plan_svg(run_plan(PLAN_COMMAND), PLAN_COMMAND))
        print(f"written: {args.out / 'plan.svg'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
