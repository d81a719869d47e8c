"""Does one configuration train the same under every layout? The launches, the comparison
and the verdict behind `python -m trainer.certify` (its help, trainer/certify.py's docstring,
says what it does)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.checks.compare import CompareError, Series, difference, read_series
from trainer.config.errors import ConfigError, UserError
from trainer.tracking.plurals import counted

DEFAULT_LAYOUTS = ("accum", "ddp2", "fsdp2", "pp2", "tp2", "tpsp2", "cp2", "auto")
COMPARED = ("train/loss", "train/grad_norm")
# A mixture of experts records a fingerprint of each step's routing (engine/moe/sums.py).
ROUTING = "train/moe_routing_digest"
MIXTURE_HORIZON = (
    "a mixture of experts is compared over the steps before its routing first differs from "
    f"the reference's ({ROUTING}): each step is exact for the same weights, but float "
    "rounding grows with the steps until some token's k-th and (k+1)-th experts trade places, "
    "and from there the runs apply different gradients (README, Mixture of experts)"
)
# (atol, rtol) per precision. float32 layouts differ by summation order only (gpt_tiny: 5e-7
# at most, most layouts bitwise); bf16 and fp16 round every matmul to 8 / 11 bits of mantissa
# (gpt_tiny in bf16, 10 steps: fsdp2 4e-3 off in gradient norm, 1e-4 relative in loss). Tight
# enough that a mean-instead-of-sum loss (a few % off) does not pass. fp8 scales each
# micro-batch's activations by their own maximum, yet splits as bf16 does (gpt_tiny emulated,
# 10 steps, micro 8 x 2 against 4 x 4: loss 5.9e-5 relative, grad norm 9.2e-4; bf16 2.5e-5 and
# 4.4e-4).
TOLERANCE = {
    "fp32": (1e-5, 1e-5),
    "bf16": (1e-6, 1e-2),
    "fp16": (1e-6, 5e-3),
    "fp8": (1e-6, 1e-2),
}
EXIT_DIFFERENT, EXIT_BAD_INPUT = 1, 2
_NAME = re.compile(r"(ddp|fsdp|pp|tpsp|tp|cp|ep)(\d*)")
# Of a model whose mixture-of-experts layers dist.ep can split, besides DEFAULT_LAYOUTS.
EXPERT_LAYOUTS = ("ep2",)


@dataclass
class Settings:
    """`certify.*`: what to run and how close is close enough."""

    layouts: list[str] | None = None  # null: DEFAULT_LAYOUTS (+ EXPERT_LAYOUTS: default_layouts)
    steps: int = 5
    dir: str | None = None  # null: outputs/certify/<date>/<time>
    atol: float | None = None  # null: by train.precision (TOLERANCE)
    rtol: float | None = None
    timeout_s: float = 900.0  # per launch


@dataclass
class Layout:
    """One way to launch the same run."""

    name: str
    nproc: int
    overrides: list[str]  # the layout's own (batch cut and parallelism)
    skip: str = ""  # why it cannot run here ('' when it can)
    what: str = ""  # the overrides that make it this layout


@dataclass
class Outcome:
    """What became of one layout."""

    name: str
    nproc: int
    overrides: list[str]
    status: str  # reference | same | different | failed | skipped
    reason: str = ""
    max_diff: dict[str, float] = field(default_factory=dict)  # metric -> max |diff|
    at_step: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    run_dir: str = ""
    routing_differs_at: int | None = None  # a mixture: the first step routed unlike the reference


def parse(argv: list[str]) -> tuple[Settings, list[str]]:
    """Split the command line into `certify.*` settings and the training overrides."""
    settings, overrides = Settings(), []
    names = {f for f in Settings.__dataclass_fields__}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not key.startswith("certify."):
            overrides.append(arg)
            continue
        name = key.removeprefix("certify.")
        if not sep or name not in names:
            raise ConfigError(
                key,
                f"unknown key or missing value. Valid keys: "
                f"{', '.join(f'certify.{n}' for n in sorted(names))}",
            )
        try:
            if name == "layouts":
                items = value.strip().removeprefix("[").removesuffix("]").split(",")
                settings.layouts = layouts = [i.strip() for i in items if i.strip()]
                for layout in layouts:
                    if layout not in ("single", "accum", "auto") and not _NAME.fullmatch(layout):
                        raise ValueError(f"unknown layout {layout!r}")
            elif name == "steps":
                settings.steps = int(value)
                if settings.steps < 1:
                    raise ValueError("must be at least 1")
            elif name == "dir":
                settings.dir = value or None
            elif name in ("atol", "rtol", "timeout_s"):
                number = None if value in ("null", "") else float(value)
                if number is not None and number < 0:
                    raise ValueError("must be >= 0")
                if name == "timeout_s":
                    settings.timeout_s = number or Settings.timeout_s
                else:
                    setattr(settings, name, number)
        except ValueError as exc:
            raise ConfigError(
                key,
                f"{exc} (got {value!r}). Layouts: single, accum, auto, ddpN, fsdpN, ppN, tpN, "
                "tpspN, cpN, epN (N processes, 2 by default), e.g. certify.layouts=[accum,ddp2]",
            ) from None
    return settings, overrides


def largest_divisor(n: int, at_most: int, at_least_parts: int = 1) -> int | None:
    """The largest d <= at_most dividing n into at least `at_least_parts` parts."""
    for d in range(min(n, at_most), 0, -1):
        if n % d == 0 and n // d >= at_least_parts:
            return d
    return None


def plan(name: str, batch: int, micro: int, slots: int, unit: str) -> Layout:
    """The layout `name` for global batch `batch` and reference micro-batch `micro`, on a
    machine that hosts `slots` processes (`unit`: what a slot is)."""
    dist = {"dist.strategy": "ddp", "dist.pp": 1, "dist.tp": 1, "dist.cp": 1, "dist.ep": 1}
    dist["dist.tp_sequence_parallel"] = "false"
    if name in ("single", "accum", "auto"):
        nproc, kind = 1, name
    else:
        match = _NAME.fullmatch(name)
        assert match is not None  # parse() checked it
        kind, nproc = match.group(1), int(match.group(2) or 2)
    layout = Layout(name, nproc, [])
    if nproc > slots:
        layout.skip = f"needs {nproc} processes; this machine hosts {slots} ({unit})"
        return layout
    m: int | str | None = micro
    if kind == "accum":
        m = largest_divisor(batch, micro - 1) if micro > 1 else (batch if batch > 1 else None)
        if m is None:
            layout.skip = "a global batch of 1 has only one split"
    elif kind == "auto":
        m = "auto"
    elif kind in ("ddp", "fsdp", "ep"):
        if kind == "ep":  # DDP over the N ranks, each holding 1/N of the experts
            dist["dist.ep"] = nproc
        else:
            dist["dist.strategy"] = kind
        if batch % nproc:
            layout.skip = f"the global batch {batch} does not divide over {nproc} ranks"
        else:
            m = largest_divisor(batch // nproc, micro)
    elif kind == "pp":
        dist["dist.pp"] = nproc
        m = largest_divisor(batch, micro, at_least_parts=nproc)
        if m is None:
            layout.skip = f"the global batch {batch} has fewer samples than {nproc} stages"
    elif kind in ("tp", "tpsp"):
        dist["dist.tp"] = nproc
        if kind == "tpsp":
            dist["dist.tp_sequence_parallel"] = "true"
    elif kind == "cp":
        dist["dist.cp"] = nproc
    layout.overrides = [f"train.micro_batch_size={m}", *(f"{k}={v}" for k, v in dist.items())]
    plain = {"dist.strategy=ddp", "dist.pp=1", "dist.tp=1", "dist.cp=1", "dist.ep=1"}
    plain.add("dist.tp_sequence_parallel=false")
    layout.what = " ".join(o for o in layout.overrides if o not in plain)
    return layout


def default_layouts(cfg: Any) -> list[str]:
    """DEFAULT_LAYOUTS, and EXPERT_LAYOUTS for a model with mixture-of-experts layers whose
    experts dist.ep splits (engine/parallel/expert.py's HasExperts: the in-tree GPT's
    model.moe, transformers' mixtures whose experts transformers declares): the model built
    on fake tensors (no memory, no initialization's time)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from engine.distributed import DistInfo
    from engine.parallel.expert import HasExperts
    from trainer.run.assemble import build_model

    with FakeTensorMode(allow_non_fake_inputs=True):
        model, _ = build_model(cfg.model, DistInfo(0, 1, 0, torch.device("cpu")))
    splits = isinstance(model, HasExperts) and bool(model.expert_layers())
    return [*DEFAULT_LAYOUTS, *(EXPERT_LAYOUTS if splits else ())]


def machine_slots() -> tuple[int, str]:
    """How many processes of one run this machine hosts: its GPUs, or its CPU cores."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPUs"
    return len(os.sched_getaffinity(0)), "CPU cores"


def merged(*groups: list[str]) -> list[str]:
    """Overrides in order, a later value of the same key replacing an earlier one."""
    out: dict[str, str] = {}
    for group in groups:
        for arg in group:
            key = arg.partition("=")[0].lstrip("+~")
            out.pop(key, None)
            out[key] = arg
    return list(out.values())


def command(nproc: int, overrides: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "trainer.train", *overrides]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [sys.executable, *launcher, "-m", "trainer.train", *overrides]


def refusal(output: str) -> str | None:
    """The trainer's one-paragraph error (`error: ...`), if it printed one."""
    for line in output.splitlines():
        if line.startswith("error: ") or re.match(r"error \(rank \d+\): ", line):
            return line.partition(": ")[2].strip()
    return None


# A Python exception's own line (`ValueError: ...`, `[rank 1] torch.OutOfMemoryError: ...`).
_EXCEPTION = re.compile(r"^(\[rank \d+\] )?([A-Za-z_][\w.]*(Error|Exception|Interrupt)): .+")


def crash_line(output: str) -> str:
    """What a crashed launch died of: the last exception line a rank printed, else its last
    line before torchrun's failure report (a banner of `=` and `-` rules that names no cause).
    """
    lines = [line for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION.match(line):
            return line[:300]
    cut = next((i for i, ln in enumerate(lines) if "FAILED" in ln and ln.endswith("FAILED")), None)
    if cut is not None and cut > 0:  # torchrun's report starts with "<module> FAILED"
        lines = lines[:cut]
    lines = [ln for ln in lines if not set(ln.strip()) <= set("=-")]
    return lines[-1][:300] if lines else "(no output)"


@dataclass
class Running:
    """A layout's launch in flight."""

    layout: Layout
    proc: subprocess.Popen
    log: Any  # its open output file
    slots: list[int]
    started: float


def start(layout: Layout, base: list[str], work: Path, slots: list[int], gpus: bool) -> Running:
    """Launch `layout` on `slots` (GPU indices when `gpus`), its output in `work/NAME.log`."""
    overrides = merged(base, layout.overrides, [f"hydra.run.dir={work / layout.name}"])
    environ = dict(os.environ)
    if gpus:  # each launch its own GPUs (indices into the ones this process sees)
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(max(slots) + 1)]
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in slots)
    log = (work / f"{layout.name}.log").open("w")
    proc = subprocess.Popen(
        command(layout.nproc, overrides),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=environ,
        start_new_session=True,  # a timeout kills torchrun's workers with it
    )
    return Running(layout, proc, log, slots, time.perf_counter())


def finish(run: Running, work: Path, code: int) -> Outcome:
    """What became of a launch that ended with `code` (not yet compared)."""
    run.log.close()
    layout, run_dir = run.layout, work / run.layout.name
    output = (work / f"{layout.name}.log").read_text(errors="replace")
    outcome = Outcome(layout.name, layout.nproc, layout.overrides, "ran", run_dir=str(run_dir))
    outcome.seconds = time.perf_counter() - run.started
    metrics = run_dir / "metrics.jsonl"
    records = metrics.is_file() and metrics.stat().st_size > 0
    if code == 0:
        return outcome
    if not records and (reason := refusal(output)) is not None:
        outcome.status, outcome.reason = "skipped", f"the trainer refuses it: {reason}"
    else:
        outcome.status = "failed"
        outcome.reason = f"exit {code}: {refusal(output) or crash_line(output)}"
    return outcome


def run_layouts(
    layouts: list[Layout], base: list[str], work: Path, settings: Settings, slots: int, gpus: bool
) -> dict[str, Outcome]:
    """Every layout that can run, in order, as many at once as the machine's slots hold (its
    GPUs, or its CPU cores): the trajectories compared do not depend on the machine's load."""
    outcomes = {
        x.name: Outcome(x.name, x.nproc, x.overrides, "skipped", x.skip) for x in layouts if x.skip
    }
    pending = [x for x in layouts if not x.skip]
    free: list[int] = list(range(slots))
    running: list[Running] = []
    try:
        schedule(pending, running, free, outcomes, base, work, settings, gpus)
    finally:  # Ctrl-C, or any error here: no launch outlives the command
        for run in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL)
    return outcomes


def schedule(
    pending: list[Layout],
    running: list[Running],
    free: list[int],
    outcomes: dict[str, Outcome],
    base: list[str],
    work: Path,
    settings: Settings,
    gpus: bool,
) -> None:
    """Start the pending layouts in order as slots free up; collect each as it ends."""
    while pending or running:
        while pending and pending[0].nproc <= len(free):
            layout = pending.pop(0)
            taken = free[: layout.nproc]
            del free[: layout.nproc]
            running.append(start(layout, base, work, taken, gpus))
        time.sleep(0.1)
        for run in list(running):
            code = run.proc.poll()
            if code is None and time.perf_counter() - run.started > settings.timeout_s:
                os.killpg(run.proc.pid, signal.SIGKILL)
                code = run.proc.wait()
                run.log.write(f"\ncertify: killed after {settings.timeout_s:.0f} s\n")
            if code is None:
                continue
            running.remove(run)
            free[:] = sorted(free + run.slots)
            outcome = outcomes[run.layout.name] = finish(run, work, code)
            print(f"  {outcome.name}: done in {outcome.seconds:.1f} s", flush=True)


def first_routing_difference(reference: dict[str, Series], have: dict[str, Series]) -> int | None:
    """The first step a mixture's layout routed unlike the reference (None: every step alike,
    or not a mixture)."""
    want, got = reference.get(ROUTING, {}), have.get(ROUTING, {})
    return next((step for step in sorted(want) if got.get(step) != want[step]), None)


def judge(outcome: Outcome, reference: Path, steps: int, atol: float, rtol: float) -> None:
    """Compare a layout that ran with the reference: `same` or `different`; a mixture over the
    steps before its routing first differs (MIXTURE_HORIZON)."""
    try:
        want, have = read_series(reference), read_series(outcome.run_dir)
    except CompareError as exc:
        outcome.status, outcome.reason = "failed", str(exc)
        return
    cut = outcome.routing_differs_at = first_routing_difference(want, have)
    if cut == 1:
        outcome.status = "different"
        outcome.reason = (
            "routes step 1 unlike the reference from the same weights (a routing that depends "
            "on the split, or a near-tie the forward's rounding broke)"
        )
        return
    diffs = []
    for metric in COMPARED:
        a, b = (
            {s: v for s, v in series.get(metric, {}).items() if cut is None or s < cut}
            for series in (want, have)
        )
        if (d := difference(metric, a, b, atol, rtol)) is not None:
            diffs.append(d)
            outcome.max_diff[metric], outcome.at_step[metric] = d.max_abs, d.at_step
    missing = [m for m in COMPARED if len(have.get(m, {})) != steps or m not in outcome.max_diff]
    if missing:
        outcome.status = "failed"
        outcome.reason = f"recorded {', '.join(missing)} at fewer than {steps} steps"
        return
    horizon = "" if cut is None else f"over steps 1-{cut - 1}: routing differs from step {cut}"
    if all(d.within for d in diffs):
        outcome.status, outcome.reason = "same", horizon
    else:
        outcome.status = "different"
        outcome.reason = ", ".join(
            f"{d.metric} differs by {d.max_abs:.2e} at step {d.at_step}"
            for d in diffs
            if not d.within
        ) + (f" ({horizon})" if horizon else "")


def table(outcomes: list[Outcome], atol: float, rtol: float, mixture: bool = False) -> str:
    """The printed table: one line per layout, the verdict last; for a `mixture` (of experts)
    the horizon it was compared over, and why."""
    head = ("layout", "ranks", "max |d loss|", "max |d grad norm|", "verdict")
    rows = []
    for o in outcomes:
        loss = o.max_diff.get("train/loss")
        norm = o.max_diff.get("train/grad_norm")
        verdict = {
            "reference": "reference",
            "same": f"same {o.reason}" if o.reason else "same",
            "different": f"DIFFERENT: {o.reason}",
            "failed": f"FAILED: {o.reason}",
            "skipped": f"skipped: {o.reason}",
        }[o.status]
        rows.append(
            (
                o.name,
                str(o.nproc),
                "-" if loss is None else f"{loss:.2e}",
                "-" if norm is None else f"{norm:.2e}",
                verdict,
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4]
        for row in [head, *rows]
    ]
    bad = [o.name for o in outcomes if o.status in ("different", "failed")]
    compared = [o for o in outcomes if o.status in ("same", "different")]
    tol = f"|diff| <= {atol:g} + {rtol:g} x |value|"
    if bad:
        lines.append(
            f"NOT CERTIFIED: {', '.join(bad)} {'differs' if len(bad) == 1 else 'differ'} "
            f"from the reference ({tol})"
        )
    elif compared:
        lines.append(
            f"CERTIFIED: {counted(len(compared), 'layout')} "
            f"{'trains' if len(compared) == 1 else 'train'} as the reference ({tol})"
        )
    else:
        lines.append("NOTHING CERTIFIED: no layout could be compared with the reference")
    if mixture:
        lines.append(f"({MIXTURE_HORIZON})")
    return "\n".join(lines)


def validate(overrides: list[str]) -> Any:
    """The composed, validated config of `overrides` (UserError: one paragraph), as the
    trainer will see it: a bad override stops here, before any launch."""
    from trainer.api import compose
    from trainer.config.cli import to_config

    try:
        return to_config(compose(overrides))[0]
    except UserError:
        raise
    except Exception as exc:  # Hydra's own composition errors
        raise UserError(str(exc).strip().splitlines()[0]) from None


def certify(settings: Settings, user: list[str]) -> int:
    """Run every layout and compare; returns the exit code."""
    cfg = validate(user)
    micro = cfg.train.micro_batch_size
    batch = cfg.train.global_batch_size
    if batch is None:
        if micro == "auto":
            raise ConfigError("train.global_batch_size", "train.micro_batch_size=auto needs it")
        batch = micro * cfg.train.grad_accum_steps
    micro = micro if isinstance(micro, int) else batch
    micro = largest_divisor(batch, micro) or 1
    default_atol, default_rtol = TOLERANCE[cfg.train.precision]
    atol = settings.atol if settings.atol is not None else default_atol
    rtol = settings.rtol if settings.rtol is not None else default_rtol
    stamp = datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    work = Path(settings.dir or f"outputs/certify/{stamp}").resolve()
    base = merged(
        user,
        [
            f"train.max_steps={settings.steps}",
            "train.log_every=1",
            f"train.global_batch_size={batch}",
            "eval.every_steps=0",
            "checkpoint.every_steps=0",
            "checkpoint.resume=never",
            "logger=none",
        ],
    )
    validate(merged(base, plan("single", batch, micro, 1, "").overrides))
    chosen = settings.layouts if settings.layouts is not None else default_layouts(cfg)
    if work.exists() and any(work.iterdir()):
        raise ConfigError("certify.dir", f"{work} is not empty: name a new directory")
    work.mkdir(parents=True, exist_ok=True)
    slots, unit = machine_slots()
    print(
        f"certify: global batch {batch}, {counted(settings.steps, 'step')} per layout, tolerance "
        f"atol {atol:g} rtol {rtol:g}, this machine hosts {counted(slots, 'process', 'processes')} "
        f"({unit}); runs in {work}",
        flush=True,
    )
    names = ["single", *[n for n in dict.fromkeys(chosen) if n != "single"]]
    layouts = [plan(name, batch, micro, slots, unit) for name in names]
    for layout in layouts:
        ranks = counted(layout.nproc, "rank")
        doing = f"skipped ({layout.skip})" if layout.skip else f"{ranks}, {layout.what}"
        print(f"  {layout.name}: {doing}", flush=True)
    done = run_layouts(layouts, base, work, settings, slots, unit == "GPUs")
    outcomes = [done[name] for name in names]
    if outcomes[0].status != "ran":
        print(
            f"error: the reference run (one process) did not finish: {outcomes[0].reason}. "
            f"Its output: {work / 'single.log'}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    outcomes[0].status = "reference"
    for outcome in outcomes[1:]:
        if outcome.status == "ran":
            judge(outcome, work / "single", settings.steps, atol, rtol)
    reference = work / "single" / "metrics.jsonl"
    mixture = reference.is_file() and ROUTING in read_series(reference)
    text = table(outcomes, atol, rtol, mixture)
    print(text, flush=True)
    write_outputs(work, outcomes, text, atol, rtol, batch)
    if any(o.status in ("different", "failed") for o in outcomes):
        return EXIT_DIFFERENT
    return 0 if any(o.status == "same" for o in outcomes) else EXIT_BAD_INPUT


def write_outputs(
    work: Path, outcomes: list[Outcome], text: str, atol: float, rtol: float, batch: int
) -> None:
    """certify.json, and certify.html: the table above the runs' overlaid curves."""
    (work / "certify.json").write_text(
        json.dumps(
            {
                "global_batch_size": batch,
                "atol": atol,
                "rtol": rtol,
                "compared": list(COMPARED),
                "layouts": [asdict(o) for o in outcomes],
            },
            indent=2,
        )
    )
    from trainer.tracking.report import build_report

    ran = [o for o in outcomes if o.run_dir and Path(o.run_dir, "metrics.jsonl").is_file()]
    try:
        build_report(
            [Path(o.run_dir) for o in ran],
            work / "certify.html",
            names=[o.name for o in ran],
            preface=("python -m trainer.certify", text),
        )
        print(f"report: {work / 'certify.html'}", flush=True)
    except Exception as exc:  # the verdict stands without its page
        print(f"WARNING: certify.html not written ({type(exc).__name__}: {exc})", file=sys.stderr)
