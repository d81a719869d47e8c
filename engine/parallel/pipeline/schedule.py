"""Pipeline schedules as plain lists: which stage runs which micro-batch's forward or backward,
in order, on one rank.

A schedule is data, not code: the runtime (engine/parallel/pipeline/) walks a rank's list, blocking
only on receives, while sends go out asynchronously. Any list that respects the data
dependencies (a stage's forward needs the previous stage's forward of the same micro-batch,
its backward the next stage's backward) then runs without deadlock; `simulate` checks that
for every rank's list together, so a new schedule is tested before it ever runs.

Stages are numbered 0..S-1 over the whole pipeline (S = pp x virtual stages); stage `s`
lives on pipeline rank `s % pp` (the interleaved layout; with one stage per rank, stage =
rank).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Action:
    """`kind` F (forward) or B (backward) of micro-batch `micro` on stage `stage`."""

    kind: str
    stage: int
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.micro}"


def actions(schedule: str, pp: int, rank: int, n_micro: int, virtual: int = 1) -> list[Action]:
    """Rank `rank`'s actions for one window of `n_micro` micro-batches."""
    if schedule == "gpipe":
        if virtual != 1:
            raise ValueError("gpipe runs one stage per rank (dist.pp_virtual=1)")
        return [Action("F", rank, m) for m in range(n_micro)] + [
            Action("B", rank, m) for m in range(n_micro)
        ]
    if schedule == "1f1b":
        if virtual != 1:
            raise ValueError("1f1b runs one stage per rank (dist.pp_virtual=1)")
        return _one_f_one_b(pp, rank, n_micro)
    if schedule == "interleaved_1f1b":
        return _interleaved(pp, rank, n_micro, virtual)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")


def _one_f_one_b(pp: int, rank: int, n_micro: int) -> list[Action]:
    """Warm up with the forwards that fill the pipeline below this rank, then alternate one
    forward and one backward, then drain: at most pp - rank micro-batches' activations live."""
    warm = min(pp - 1 - rank, n_micro)
    out = [Action("F", rank, m) for m in range(warm)]
    for i in range(n_micro - warm):
        out += [Action("F", rank, warm + i), Action("B", rank, i)]
    out += [Action("B", rank, m) for m in range(n_micro - warm, n_micro)]
    return out


def _interleaved(pp: int, rank: int, n_micro: int, virtual: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: each rank holds `virtual` stages (chunks); micro-batches
    go through the chunks in groups of `pp`. Needs `n_micro` to be a multiple of `pp`."""
    if n_micro % pp:
        raise ValueError(
            f"interleaved_1f1b needs the micro-batches per step ({n_micro}) to be a multiple "
            f"of dist.pp={pp}"
        )
    total = n_micro * virtual

    def at(k: int, kind: str) -> Action:
        chunk = (k // pp) % virtual
        if kind == "B":
            chunk = virtual - 1 - chunk
        micro = (k // (pp * virtual)) * pp + k % pp
        return Action(kind, chunk * pp + rank, micro)

    warm = min((pp - rank - 1) * 2 + (virtual - 1) * pp, total)
    out = [at(k, "F") for k in range(warm)]
    for i in range(total - warm):
        out += [at(warm + i, "F"), at(i, "B")]
    out += [at(k, "B") for k in range(total - warm, total)]
    return out


def simulate(lists: list[list[Action]], n_stages: int) -> int:
    """Run every rank's list with blocking receives and asynchronous sends; return the number
    of rounds it takes. Raises `RuntimeError` on a deadlock or a broken dependency (an action
    missing, repeated, or run before what it needs)."""
    done: set[Action] = set()
    pos = [0] * len(lists)
    rounds = 0
    while any(p < len(a) for p, a in zip(pos, lists)):
        rounds += 1
        ready = []
        for r, (p, acts) in enumerate(zip(pos, lists)):
            if p == len(acts):
                continue
            a = acts[p]
            if a.kind == "F":
                needs = [] if a.stage == 0 else [Action("F", a.stage - 1, a.micro)]
            else:
                needs = [Action("F", a.stage, a.micro)]
                if a.stage < n_stages - 1:
                    needs.append(Action("B", a.stage + 1, a.micro))
            if all(n in done for n in needs):
                ready.append(r)
        if not ready:
            stuck = {r: lists[r][pos[r]] for r in range(len(lists)) if pos[r] < len(lists[r])}
            raise RuntimeError(f"pipeline schedule deadlocks waiting at {stuck}")
        for r in ready:
            a = lists[r][pos[r]]
            if a in done:
                raise RuntimeError(f"{a} runs twice")
            done.add(a)
            pos[r] += 1
    return rounds
