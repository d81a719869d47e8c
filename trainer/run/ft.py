"""`ft=torchft` in a training run: the replica groups' part in the build, the fit loop and the
records (docs/guides/fault-tolerance.md; the engine side is engine/parallel/replicas.py).

- The batch plan is the whole job's (`ft.groups` groups of this group's size); each quorum
  deals it over the live groups (`plan_for`), and a global batch that some number of live
  groups could not split into whole micro-batches is refused before anything is built.
- Every step's quorum comes first (`ReplicaWindow`): a new deal rebuilds the windows; a step
  that did not commit is redone by the next quorum with the same step number and samples
  (its module buffers and random streams rolled back first).
- A group that joins late, or comes back, takes the live state from a peer (`served_state`,
  `load_served`): the whole optimizer state with its parameter groups, the scheduler, the loss
  scale, the callbacks' state (EMA), the random streams, the step (the data position) and the
  records of the last `RING` writes. The disk is read only when no group is ahead: a fresh
  job's first quorum at step 0 (every group lost, the job launched again).
- The lowest live group id writes the records (`WriterRecords`: a new writer first writes what
  the file lacks of the records that came with the state) and the checkpoints.
- Records carry `train/groups`, `ft/failures`, `ft/redone_steps`, `ft/lost_s`, `ft/voided`
  (`FtRecords`), of committed steps only; the console says when a group is lost and when it
  comes back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engine.callbacks import Callback
from engine.checkpoint.manifest import TMP_PREFIX
from engine.distributed import DistInfo
from engine.parallel.base import Parallelism
from engine.parallel.replicas import (
    DealChanged,
    DuplicateGroup,
    Quorum,
    QuorumFailed,
    ReplicaGroups,
    ReplicaSettings,
    Replicated,
    StepNotCommitted,
    UnevenGroups,
)
from engine.rng import rng_state, set_rng_state
from trainer.config.errors import ConfigError, UserError
from trainer.config.schema import FtCfg, TrainCfg
from trainer.data.checks import next_window
from trainer.run.batch_plan import BatchPlan
from trainer.run.fit import RunEnded
from trainer.tracking.plurals import counted
from trainer.tracking.records import RecordSink, supersede
from trainer.tracking.sinks import announce, open_sinks

# Records kept in every group (and sent with its state): what a new writer may have to write.
RING = 64
# What `WriterRecords.overtaken` reads of metrics.jsonl's end: more than any one record.
TAIL_BYTES = 65536
# Attempts at one step before the run stops: groups lost again and again, or a broken link.
MAX_ATTEMPTS = 10


class LighthouseLost(RunEnded):
    """The quorum stopped coming: every group stops (the writer saved the last committed
    step)."""

    outcome = "stopped: no quorum"


def replica_settings(cfg: FtCfg) -> ReplicaSettings:
    return ReplicaSettings(
        cfg.address, cfg.group, cfg.groups, cfg.min_groups, cfg.timeout_s, cfg.async_quorum
    )


def job_plan(train: TrainCfg, ft: FtCfg, group_dp: int) -> BatchPlan:
    """The batch plan of the whole job (`ft.groups` groups of `group_dp` data-parallel ranks),
    refused unless every number of live groups from `ft.min_groups` on can split the global
    batch into whole micro-batches."""
    counts = [n * group_dp for n in range(ft.min_groups, ft.groups + 1)]
    if train.global_batch_size is not None and isinstance(train.micro_batch_size, int):
        micro, total = train.micro_batch_size, train.global_batch_size
        bad = [n for n in counts if total % micro or (total // micro) % n]
        if bad:
            need = lcm(*counts) * micro
            raise ConfigError(
                "train.global_batch_size",
                f"{total} samples cannot be dealt in whole micro-batches of {micro} over "
                f"{counts.index(bad[0]) + ft.min_groups} live replica group(s) of {group_dp} "
                f"data-parallel rank(s): under ft every number of live groups from "
                f"ft.min_groups={ft.min_groups} to ft.groups={ft.groups} must split the step's "
                f"micro-batches evenly; valid global batches are multiples of {need} "
                f"(micro-batch {micro} x {need // micro}), or raise ft.min_groups",
            )
    return BatchPlan.from_config(train, group_dp * ft.groups)


def lcm(*values: int) -> int:
    from math import gcd

    out = 1
    for v in values:
        out = out * v // gcd(out, v)
    return out


def plan_for(plan: BatchPlan, groups: int, group_dp: int) -> BatchPlan:
    """The global batch of `plan` dealt over `groups` live groups of `group_dp` ranks."""
    dp = groups * group_dp
    return BatchPlan(plan.micro, plan.global_batch // (plan.micro * dp), dp, plan.global_batch)


def shared_run_id(run_dir: Path) -> str:
    """One run id for every group of a job (they share the run directory)."""
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]


# --------------------------------------------------------------------------- records


class FtRecords(Callback):
    """What the records and the summary say of the replica groups (`train/groups`,
    `ft/failures`, `ft/redone_steps`, `ft/lost_s`, `ft/voided`), and the records of the last `RING`
    writes: state that travels with the group's state and is saved in checkpoints."""

    state_optional = True  # a checkpoint of a run without ft resumes under ft

    def __init__(self, group: int, waited: Callable[[], float] | None = None) -> None:
        self.group = group
        self.waited = waited  # seconds this group's steps waited for their quorums
        self.failures = 0  # attempts that did not commit
        # Attempts voided by a quorum that, formed during their first forward, dealt otherwise
        # (a group came or went between two steps).
        self.voided = 0
        self.redone_steps = 0  # steps that needed more than one attempt
        self.lost_s = 0.0  # wall time from each failed or voided attempt's start to the next's
        self.live: tuple[int, ...] = ()  # the groups of the last committed step
        self.ring: list[dict[str, Any]] = []
        # Each record of `ring` as JSON, written once: the state is taken at every step's
        # start under an overlapped quorum (dumping 64 records each time cost 0.76 ms).
        self.ring_json: list[str] = []

    @property
    def writes(self) -> bool:
        """Whether this group writes records and checkpoints: the lowest live id."""
        return bool(self.live) and self.live[0] == self.group

    def keep(self, record: dict[str, Any]) -> None:
        self.ring = [*self.ring[-(RING - 1) :], record]
        self.ring_json = [*self.ring_json[-(RING - 1) :], json.dumps(record)]

    def metrics(self) -> dict[str, Any]:
        return {
            "train/groups": len(self.live),
            "ft/failures": self.failures,
            "ft/redone_steps": self.redone_steps,
            "ft/lost_s": self.lost_s,
            "ft/voided": self.voided,
            # This group's own: not part of the state that travels.
            "ft/quorum_wait_s": self.waited() if self.waited is not None else 0.0,
        }

    def summary(self, global_batch_size: int) -> str | None:
        del global_batch_size
        if not self.redone_steps:
            return "  fault tolerance: no step failed"
        voided = f", {self.voided} voided by a change of the live groups" if self.voided else ""
        return (
            f"  fault tolerance: {counted(self.failures, 'failed attempt')}{voided}, "
            f"{counted(self.redone_steps, 'step')} redone by the live groups, "
            f"{self.lost_s:.1f} s lost"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "failures": self.failures,
            "redone_steps": self.redone_steps,
            "lost_s": self.lost_s,
            "voided": self.voided,
            "live": list(self.live),
            # One string: a sharded checkpoint keeps it whole.
            "ring": "[" + ", ".join(self.ring_json) + "]",
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.failures = int(state["failures"])
        self.redone_steps = int(state["redone_steps"])
        self.lost_s = float(state["lost_s"])
        self.voided = int(state.get("voided", 0))  # absent from checkpoints before it
        self.live = tuple(state["live"])
        self.ring = json.loads(state["ring"])
        self.ring_json = [json.dumps(r) for r in self.ring]


def record_kind(record: dict[str, Any]) -> tuple[int, str]:
    """A record's step and kind (training or evaluation): metrics.jsonl has one of each."""
    return int(record["step"]), "train" if "train/loss" in record else "val"


class WriterRecords(RecordSink):
    """Rank 0's records in a group: every record is kept (`FtRecords.keep`), and written only
    while this group is the writer. A group that becomes the writer first writes the kept
    records that metrics.jsonl lacks (the last writer was lost before writing them), then
    goes on. The sinks open at the first write (`open_sinks`), once any disk resume has
    moved the records after it aside."""

    def __init__(
        self, records: FtRecords, path: Path, open_sinks: Callable[[], list[RecordSink]]
    ) -> None:
        self.records, self.path, self.open_sinks = records, path, open_sinks
        self.sinks: list[RecordSink] | None = None
        self.wrote_last = False

    def write(self, record: dict[str, Any]) -> None:
        self.records.keep(record)
        if not self.records.writes:
            self.wrote_last = False
            return
        if self.sinks is None:
            self.sinks = self.open_sinks()
        if self.wrote_last and self.overtaken(record):
            # This group stalled after its step (the others went on without it, and one of
            # them wrote this record): it writes again from its next committed step on.
            self.wrote_last = False
            return
        pending = self.missing() if not self.wrote_last else [record]
        for kept in pending:
            for sink in self.sinks:
                sink.write(kept)
        self.wrote_last = True

    def overtaken(self, record: dict[str, Any]) -> bool:
        """Whether metrics.jsonl's last record is this one's step or a later one: another
        group wrote it meanwhile. Reads the file's tail only."""
        if not self.path.exists():
            return False
        with self.path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
        for line in reversed(lines):
            try:
                last = record_kind(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue  # a half-written line, or the tail's cut first line
            return last[0] > record["step"] or last == record_kind(record)
        return False

    def missing(self) -> list[dict[str, Any]]:
        """The kept records (this one last) that metrics.jsonl does not hold."""
        written = set()
        if self.path.exists():
            end_partial_line(self.path)
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    written.add(record_kind(json.loads(line)))
                except (ValueError, KeyError, TypeError):
                    continue
        return [r for r in self.records.ring if record_kind(r) not in written]

    def close(self) -> None:
        for sink in self.sinks or []:
            sink.close()

    def closing_note(self) -> str | None:
        notes = [note for sink in self.sinks or [] if (note := sink.closing_note())]
        return "\n".join(notes) or None


def end_partial_line(path: Path) -> None:
    """Cut a last line that a writer killed mid-write left without its newline."""
    with path.open("rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


# --------------------------------------------------------------------------- the state


def served_state(run: Any) -> dict[str, Any]:
    """What a group behind receives from this rank (its own values: every rank sends to the
    same rank of the healing group, laid out alike): the model's and the optimizer's whole
    state dicts (parameter groups and learning rates included), every registered component
    (progress, scheduler, loss scale, callbacks, the meter) and the random streams."""
    state = run.state
    return {
        "model": buffers_cloned(state.model),
        "optimizer": state.optimizer.state_dict(),
        "components": state.component_states(),
        "rng": rng_state(),
    }


def buffers_cloned(model: Any) -> dict[str, Any]:
    """The model's state dict, its buffers copied: a forward changes some in place (BatchNorm's
    statistics) while a state taken at the step's start is served (parameters change only in
    the update, after the serving ends)."""
    buffers = {b.data_ptr() for b in model.buffers() if type(b) is torch.Tensor}
    return {
        k: v.clone() if type(v) is torch.Tensor and v.data_ptr() in buffers else v
        for k, v in model.state_dict().items()
    }


def load_served(run: Any, served: dict[str, Any]) -> None:
    """Put a peer's state (`served_state`, its tensors already copied) in place."""
    state = run.state
    state.model.load_state_dict(served["model"])
    with state.parallel.optimizer_context():
        state.optimizer.load_state_dict(served["optimizer"])
    state.load_components(served["components"])
    set_rng_state(served["rng"])


# --------------------------------------------------------------------------- the run


class FaultTolerance:
    """This group's part in an `ft=torchft` job: its replica groups (the torchft Manager,
    started at the first step), their records, and the pieces the build puts in the run."""

    def __init__(self, cfg: FtCfg, info: DistInfo, seed: int) -> None:
        self.cfg, self.info, self.seed = cfg, info, seed
        self.run: Any = None  # the run, once built (`attach`)
        self.replicas = ReplicaGroups(
            replica_settings(cfg),
            info,
            save=lambda: served_state(self.run),
            load=lambda served: load_served(self.run, served),
        )
        self.records = FtRecords(cfg.group, lambda: self.replicas.waited_s)
        self.resuming: Any = None  # trainer/run/state.py's ResumeSettings, for the disk
        self.moved: int | None = None  # the newest record moved aside by a disk resume
        self.cleaned = False  # stale temporary saves removed (`writes_run_files`)

    def parallel(self, inner: Parallelism) -> Replicated:
        return Replicated(inner, self.replicas, self.seed)

    def fresh(self, state: Any, progress: Any, run_dir: Path) -> Any:
        """The build's start: nothing read from the disk (the first quorum decides between a
        peer's state and the newest checkpoint), streams seeded, one run id for every group."""
        from engine.rng import seed_everything
        from trainer.run.state import Resumed

        seed_everything(self.seed + 1)  # dropout draws keyed per micro-batch anyway
        progress.run_id = shared_run_id(run_dir)
        return Resumed(None, 0, progress.run_id, False)

    def attach(
        self,
        run: Any,
        resuming: Any,
        cfg: Any,
        config: dict[str, Any],
        banner: Any,
        unit: str,
    ) -> None:
        """Put this group's pieces in the built `run`: the step window, the writer's records
        (rank 0: the banner now, the sinks at the first record this group writes) and
        checkpoints. `resuming`: trainer/run/state.py's ResumeSettings."""
        self.run, self.resuming = run, resuming
        first = start(run, self)  # a peer's state or the disk's, before the first step
        if banner is not None:
            announce(cfg, config, dataclasses.replace(banner, resumed=run.resumed))

            def sinks() -> list[RecordSink]:
                opened = dataclasses.replace(banner, resumed=run.resumed)
                return open_sinks(cfg, config, opened, unit, self.moved)

            run.sinks = [WriterRecords(self.records, run.run_dir / "metrics.jsonl", sinks)]
        run.step_window = ReplicaWindow(self, run.step_window, first)
        run.writes_run_files = self.writes_run_files
        # Each group's own time by rank (the groups' ranks share no collective to gather it).
        own = run.run_dir / "ft" / f"group{self.cfg.group}"
        own.mkdir(parents=True, exist_ok=True)
        run.meter.phases.run_dir = own

    def writes_run_files(self) -> bool:
        """Whether this group writes checkpoints and the report now (the writer); before its
        first save, what a lost writer left half-written goes."""
        if not self.records.writes:
            return False
        if not self.cleaned:
            remove_stale_saves(self.run.checkpoint_dir, self.run.checkpointer.session)
            self.cleaned = True
        return True


class ReplicaWindow:
    """The fit loop's step window under ft: the quorum first, the deal it gives, the step;
    a step that did not commit is rolled back and redone (engine/parallel/replicas.py)."""

    def __init__(self, ft: FaultTolerance, inner: Any, first: Quorum | None) -> None:
        self.ft, self.inner = ft, inner
        self.first = first  # the first step's quorum, taken at the start (`start`)
        # The deal the fit loop's first windows are built for: every group live.
        self.dealt: tuple[int, int, int] | None = (ft.run.step, ft.cfg.group, ft.cfg.groups)
        self.failed_at: float | None = None  # the first failed attempt of this step began
        # After a step this group committed, the next quorum forms during the first forward.
        self.overlap = False

    def __call__(self, run: Any, window: Any, windows: Iterator[Any]) -> tuple[Any, Any]:
        first, self.first = self.first, None
        for _ in range(MAX_ATTEMPTS):
            began = time.perf_counter()
            quorum, first = first or self.quorum(run), None
            if self.dealt != (quorum.step, quorum.rank, quorum.groups):
                del window
                window, windows = self.deal(run, quorum, windows)
            start = window_start(run.ctx)
            try:
                result, windows = self.inner(run, window, windows)
            except DealChanged:  # not a failure: a group came or went between two steps
                if self.ft.replicas.healed:  # left behind, it took a peer's step start
                    self.caught_up(run)
                else:
                    start.restore()
                self.voided(began)
                continue
            except StepNotCommitted:
                start.restore()
                self.failed(run, quorum, began)
                continue
            except DuplicateGroup as exc:
                raise ConfigError(
                    "ft.group",
                    f"{exc}: every replica group needs its own id in 0 .. {self.ft.cfg.groups - 1}"
                    " (a second launch of one group, or two launch lines with one id)",
                ) from None
            except UnevenGroups as exc:
                raise UserError(
                    f"invalid config `ft`: {exc}; every replica group must have the same "
                    "number of processes (torchrun --nproc_per_node) and the same layout",
                    all_ranks=True,
                ) from None
            self.committed(run, quorum)
            # The fit loop's next window is this deal's next one.
            self.dealt, self.overlap = (quorum.step + 1, quorum.rank, quorum.groups), True
            return result, windows
        raise UserError(
            f"step {run.step + 1} failed {MAX_ATTEMPTS} times in a row across the replica "
            "groups (groups lost again and again, or a link between them broken); stopping. "
            "Rerunning the same command resumes from the newest checkpoint",
            all_ranks=True,
        )

    def quorum(self, run: Any) -> Quorum:
        try:
            quorum = self.ft.replicas.begin_step(overlap=self.overlap)
        except QuorumFailed as exc:
            lighthouse_lost(run, self.ft, exc)
        return self.checked(run, quorum)

    def checked(self, run: Any, quorum: Quorum) -> Quorum:
        if quorum.healed:
            run.meter.restart_clock()  # the transfer is not training time
        if quorum.step != run.step:
            raise RuntimeError(
                f"the quorum deals step {quorum.step + 1} but this group's state is at step "
                f"{run.step + 1}"
            )
        return quorum

    def deal(self, run: Any, quorum: Quorum, windows: Iterator[Any]) -> tuple[Any, Any]:
        """The windows of this quorum's deal, from its step on."""
        windows.close()
        parallel = run.ctx.parallel
        run.batches.plan = plan_for(run.batches.plan, quorum.groups, parallel.group_size)
        run.batches.rank = parallel.dp_rank
        windows = run.batches.windows(run.step)
        window = next_window(windows, run.batches, run.settings.data_target, run.step + 1)
        self.dealt = (quorum.step, quorum.rank, quorum.groups)
        return window, windows

    def caught_up(self, run: Any) -> None:
        """This group, left behind by the others (a long pause between two steps), took a
        live group's state in a quorum formed during its forward: nothing of its own is
        restored over it."""
        took_state(run, f"group {self.ft.cfg.group} was behind the live groups", run.step)

    def voided(self, began: float) -> None:
        """The attempt's quorum, formed during its first forward, dealt otherwise: the step
        is redone (its time is lost), dealt by a blocking quorum; nothing failed."""
        self.redone(began)
        self.ft.records.voided += 1
        self.dealt, self.overlap = None, False

    def redone(self, began: float) -> None:
        if self.failed_at is None:
            self.failed_at = began
            self.ft.records.redone_steps += 1

    def failed(self, run: Any, quorum: Quorum, began: float) -> None:
        records = self.ft.records
        self.redone(began)
        records.failures += 1
        self.dealt, self.overlap = None, False  # the next quorum deals again (blocking)
        if run.dist.is_main and records.writes:
            print(
                f"step {quorum.step + 1} not committed (a replica group was lost or hung); "
                "redoing it",
                file=sys.stderr,
                flush=True,
            )

    def committed(self, run: Any, quorum: Quorum) -> None:
        """After a committed step: the time lost to its failed attempts, the live groups, and
        the console lines of the groups that left or came back."""
        records = self.ft.records
        live = self.ft.replicas.membership.live
        redone = self.failed_at is not None
        if redone:
            records.lost_s += time.perf_counter() - self.failed_at
            self.failed_at = None
        before, records.live = records.live, live
        if run.dist.is_main and records.writes:
            for line in membership_lines(before, live, run.step, redone, run.batches.plan):
                print(line, flush=True)


def membership_lines(
    before: tuple[int, ...], live: tuple[int, ...], step: int, redone: bool, plan: BatchPlan
) -> list[str]:
    """What the writer says when step `step` (committed) was made by other groups than the
    step before it."""
    lines = []
    lost = [g for g in before if g not in live]
    if lost:
        who = ", ".join(f"group {g}" for g in lost)
        line = f"{who} lost at step {step}"
        if redone:
            each = " each" if plan.dp_size > 1 else ""
            line += (
                f"; step {step} redone by {counted(len(live), 'group')} "
                f"({counted(plan.accum, 'micro-batch', 'micro-batches')}{each})"
            )
        lines.append(line)
    for g in (g for g in live if g not in before and before):
        lines.append(f"group {g} rejoined at step {step}")
    return lines


def window_start(ctx: Any) -> Any:
    from trainer.run.auto_batch import WindowStart

    return WindowStart(ctx)


def start(run: Any, ft: FaultTolerance) -> Quorum | None:
    """The Manager, then the first quorum: a group of a fresh job waits for the others (at
    most ft.timeout_s); a group whose quorum nobody is ahead of reads the newest checkpoint
    (every group of it reads the same one). The quorum of the first step, or None when the
    step read from the disk needs one of its own."""
    cfg, replicas = ft.cfg, ft.replicas
    try:
        replicas.connect()
        if fresh_job(run):
            quorum = replicas.wait_for_groups(cfg.timeout_s)
        else:  # live groups are in the first quorum (the lighthouse waits for them)
            quorum = replicas.begin_step()
    except QuorumFailed as exc:
        raise ConfigError(
            "ft.lighthouse",
            f"no quorum from the lighthouse at {cfg.address} within ft.timeout_s="
            f"{cfg.timeout_s:g} s ({exc}); start it first with `python -m "
            "trainer.lighthouse` and pass the address it prints, with --min-groups no "
            f"more than the groups that start (ft.min_groups={cfg.min_groups})",
        ) from None
    if quorum.step == 0 and not quorum.healed:
        return None if resume_from_disk(run, ft, quorum) else quorum
    if quorum.healed:
        took_state(run, f"group {cfg.group} joined at step {quorum.step + 1}", quorum.step)
    return quorum


def took_state(run: Any, who: str, step: int) -> None:
    """After a live group's state came in: the transfer is not training time, and the main
    rank says so (`who`: which group, and why)."""
    run.meter.restart_clock()
    if run.dist.is_main:
        print(f"{who}: the state of step {step} came from a live group", flush=True)


def fresh_job(run: Any) -> bool:
    """A job's first launch: no checkpoint and no training record in its run directory (its
    groups start together: each waits for the others before the first step)."""
    from engine.checkpoint import list_checkpoints

    metrics = run.run_dir / "metrics.jsonl"
    recorded = metrics.exists() and '"train/loss"' in metrics.read_text(encoding="utf-8")
    return not recorded and not list_checkpoints(run.checkpoint_dir)


def resume_from_disk(run: Any, ft: FaultTolerance, quorum: Quorum) -> bool:
    """No group is ahead (a fresh job, or every group was lost): the newest checkpoint, as a
    run without ft resumes (or the start), and the Manager counts from its step. The first
    group of the quorum moves the records after that step aside (every group of the quorum
    reads the same checkpoint, none has written a record since)."""
    from trainer.run.state import find_resume, resume

    settings = ft.resuming
    found = find_resume(settings.resume, run.checkpoint_dir, run.dist) is not None
    if found:
        run.resumed = resume(run.state, run.progress, run.run_dir, settings, run.dist)
        run.last_saved_step = run.resumed.step
        run.checkpointer.committed = run.resumed.path
        ft.replicas.resumed_at(run.step)
    if quorum.rank == 0 and run.dist.is_main:
        ft.moved = supersede(run.run_dir / "metrics.jsonl", run.step)
    return found


def lighthouse_lost(run: Any, ft: FaultTolerance, exc: QuorumFailed) -> None:
    """The quorum stopped coming: the writer saves the last committed step, then every
    group stops with one paragraph."""
    from trainer.run.fit import save

    saved = ""
    if ft.records.writes:
        save(run, final=True)
        saved = f" Step {run.step} is saved in {run.checkpointer.committed}."
    raise LighthouseLost(
        f"invalid config `ft.lighthouse`: no quorum from the lighthouse at {ft.cfg.address} "
        f"within ft.timeout_s={ft.cfg.timeout_s:g} s at step {run.step + 1} ({exc}): the "
        f"lighthouse is gone, or fewer than ft.min_groups={ft.cfg.min_groups} groups are "
        f"live; every group stops.{saved} Start the lighthouse again and rerun the groups' "
        "commands: they resume from the newest checkpoint"
    ) from None


def remove_stale_saves(checkpoint_dir: Path, session: str) -> None:
    """The writer, before its first save: temporary directories that a lost writer left
    (never another live save's: one group writes at a time)."""
    import shutil

    if checkpoint_dir.is_dir():
        for p in checkpoint_dir.iterdir():
            if p.name.startswith(TMP_PREFIX) and not p.name.endswith(session):
                shutil.rmtree(p, ignore_errors=True)


def lock_name(cfg: FtCfg) -> str:
    """The run-directory lock of this replica group (groups share the run directory)."""
    return f".cumulus.group{cfg.group}.lock"
