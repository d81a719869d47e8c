"""What `trainer.plan` prints: the layout with every dimension, the table of roles, the
estimate, and after `plan.search=true` the ranking of layouts. Sizes under 1 GiB in MiB."""

from __future__ import annotations

from typing import Any

from engine.parallel.dims import ParallelDims

GIB, MIB = 2**30, 2**20
SEARCH_ROWS = 15  # layouts printed; plan.json lists them all


def size(nbytes: float) -> str:
    """`34.18 GiB`, `921.6 MiB`, `12.0 KiB`: GiB from 1 GiB up, MiB below."""
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    if nbytes >= MIB or nbytes == 0:
        return f"{nbytes / MIB:.1f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def describe(dims: ParallelDims) -> str:
    """Every dimension of the layout, outermost first: `pipeline 4 (1f1b) x FSDP 4 x tensor
    parallel 4`; `one GPU` when there is none."""
    parts = []
    if dims.pp > 1:
        virtual = f", {dims.pp_virtual} virtual" if dims.pp_virtual > 1 else ""
        parts.append(f"pipeline {dims.pp} ({dims.pp_schedule}{virtual})")
    if dims.dp > 1:
        parts.append(f"{dims.strategy.upper()} {dims.dp}")
    elif dims.strategy == "fsdp" and dims.cp > 1:
        parts.append("FSDP (over the context-parallel ranks)")
    if dims.ep > 1:
        parts.append(f"expert parallel {dims.ep}")
    if dims.cp > 1:
        parts.append(f"context parallel {dims.cp} ({dims.cp_impl})")
    if dims.tp > 1:
        sequence = " + sequence" if dims.sequence_parallel else ""
        parts.append(f"tensor parallel {dims.tp}{sequence}")
    return " x ".join(parts) or "one GPU"


def all_to_all(comm: dict[str, int]) -> int:
    """The bytes a rank sends in the expert all-to-alls of a step (`dist.ep`)."""
    return sum(v for k, v in comm.items() if k.startswith("alltoall") and k.endswith("/ep"))


def table(p: Any) -> str:
    """The plan as the console shows it."""
    lines = [
        f"plan: {p.layout} on {p.world} x {p.gpu} ({size(p.gpu_memory_bytes)}), "
        f"{p.parameters:,} parameters, planned in {p.seconds:.0f} s ({p.how})",
        f"{'ranks':>12} | {'peak':>10} | {'params':>10} | {'grads':>10} | {'optim':>10} | "
        f"{'activ':>10} | {'temps':>10} | fits | auto micro",
    ]
    for r in p.roles:
        m = r.memory
        span = f"{r.ranks[0]}-{r.ranks[-1]}" if len(r.ranks) > 1 else str(r.ranks[0])
        cells = (
            m.peak_bytes, m.parameters_bytes, m.gradients_bytes, m.optimizer_bytes,
            m.activations_bytes, m.temporaries_bytes,
        )  # fmt: skip
        lines.append(
            f"{span:>12} | "
            + " | ".join(f"{size(c):>10}" for c in cells)
            + f" | {'yes' if r.fits else 'NO':>4} | {r.micro_auto if r.micro_auto else '-'}"
        )
    if p.routing is not None:
        lines.append(f"mixture of experts: routing planned as {p.routing}")
    if p.mixture is not None:  # what the compute time and MFU count
        routed = "; ".join(f"{e} experts, top-{k}" for e, k in p.mixture.routing)
        lines.append(f"  {routed}: {p.mixture.active:,} parameters a token goes through")
    frozen = max((r.memory.reference_bytes for r in p.roles), default=0)
    if frozen:
        lines.append(
            f"task.reference=copy: the frozen reference's weights, {size(frozen)} per rank, "
            "are in the peak"
        )
    sent = max((all_to_all(r.comm_bytes) for r in p.roles), default=0)
    if sent:
        lines.append(
            f"expert all-to-all: {size(sent)} sent and as much received per rank per step "
            "(the routed tokens that leave the rank, under that routing)"
        )
    e = p.estimate
    lines.append(
        f"estimate (docs/plan.md's assumptions): step {e.step_time_s:.3f} s, "
        f"{e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}"
    )
    for key, seconds in sorted(e.comm_s.items()):
        if round(seconds * 1000, 1) > 0:  # a line of 0.0 ms says nothing
            lines.append(f"  {key}: {seconds * 1000:.1f} ms per step")
    return "\n".join(lines)


def search_table(layouts: list[dict[str, Any]], capacity: float) -> str:
    """The ranking of `plan.search=true`: fitting layouts first, fastest first."""
    fitting = sum(1 for lay in layouts if lay["fits"])
    lines = [
        f"layouts: {len(layouts)} valid, {fitting} fit in {size(capacity)} "
        "(memory less plan.headroom); fastest fitting first",
        f"{'#':>3} | fits | {'peak':>10} | {'step':>9} | {'how':<9} | overrides",
    ]
    for i, lay in enumerate(layouts[:SEARCH_ROWS], 1):
        step = lay["step_time_s"]
        step_text = f"{step:.3f} s" if step != float("inf") else "-"
        lines.append(
            f"{i:>3} | {'yes' if lay['fits'] else 'NO':>4} | {size(lay['peak_bytes']):>10} | "
            f"{step_text:>9} | {lay['how']:<9} | {' '.join(lay['overrides'])}"
        )
    if len(layouts) > SEARCH_ROWS:
        lines.append(f"    ({len(layouts) - SEARCH_ROWS} more in plan.json)")
    return "\n".join(lines)
