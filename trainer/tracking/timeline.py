"""One timeline of every profiled rank: the per-rank Chrome traces merged into
`RUN_DIR/profile/timeline.json.gz`, one process per rank, on one clock.

Each rank's trace (torch.profiler's Chrome JSON: `traceEvents` with microsecond `ts` relative
to the trace's `baseTimeNanoseconds`) becomes process `rank` of the merged file; its threads and
GPU streams become that process's threads, named after what they were ("thread 123 (python)",
"GPU 0 stream 7"); flow arrows keep their pairs (ids made unique per rank). Times are put on
one base. Ranks on one host share its clock; a rank on another host is moved by the difference
between its clock and rank 0's, measured where both left the same collective: the end of the
first `sync` span of the first profiled step both traced (a collective returns on every rank at
the same moment, when the last one arrives). The file opens in https://ui.perfetto.dev and
chrome://tracing.

`phase_lanes` reads a merged timeline back as each rank's phase spans, for report.html.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

from engine.timing import PHASES

Span = tuple[str, float, float]  # (name, start µs, end µs)


def load_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace, gzipped or not."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace (no traceEvents list)")
    return doc


def host_of(doc: dict[str, Any]) -> str:
    meta = doc.get("cumulus")
    if isinstance(meta, str):  # torch writes add_metadata_json values as they were given
        meta = json.loads(meta)
    return str((meta or {}).get("host") or doc.get("host_name") or "?")


def annotations(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's `record_function` spans, in time order."""
    spans = [
        e
        for e in doc["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and "ts" in e
    ]
    return sorted(spans, key=lambda e: e["ts"])


def first_sync_exits(doc: dict[str, Any], shift: float) -> dict[int, float]:
    """Per traced step: the end of its first `sync` span (µs on the shifted clock)."""
    spans = annotations(doc)
    steps = [
        (int(e["name"].split()[1]), e["ts"], e["ts"] + e.get("dur", 0))
        for e in spans
        if e["name"].startswith("step ") and e["name"].split()[1].isdigit()
    ]
    exits: dict[int, float] = {}
    for step, start, end in steps:
        for e in spans:
            if e["name"].startswith("sync") and start <= e["ts"] <= end:
                exits[step] = e["ts"] + e.get("dur", 0) + shift
                break
    return exits


def clock_offsets(docs: dict[int, dict[str, Any]], shifts: dict[int, float]) -> dict[int, float]:
    """µs to add to each rank's times to put them on the clock of the first rank's host (0 for
    ranks on that host)."""
    ranks = sorted(docs)
    ref = ranks[0]
    ref_host, ref_exits = host_of(docs[ref]), first_sync_exits(docs[ref], shifts[ref])
    offsets = {}
    for r in ranks:
        offsets[r] = 0.0
        if host_of(docs[r]) == ref_host:
            continue
        exits = first_sync_exits(docs[r], shifts[r])
        common = sorted(ref_exits.keys() & exits.keys())
        if common:
            offsets[r] = ref_exits[common[0]] - exits[common[0]]
    return offsets


def _thread_names(doc: dict[str, Any]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") != "M":
            continue
        name = (e.get("args") or {}).get("name")
        if e.get("name") == "process_name" and name:
            processes[e.get("pid")] = str(name)
        elif e.get("name") == "thread_name" and name:
            threads[(e.get("pid"), e.get("tid"))] = str(name)
    return processes, threads


def merge_traces(traces: dict[int, Path], out: Path) -> Path:
    """Merge the Chrome traces of `traces` ({rank: file}) into `out` (gzipped), written whole
    or not at all. Returns `out`."""
    docs = {r: load_trace(p) for r, p in sorted(traces.items())}
    bases = {r: int(doc.get("baseTimeNanoseconds", 0)) for r, doc in docs.items()}
    base = min(bases.values())
    shifts = {r: (bases[r] - base) / 1000.0 for r in docs}
    offsets = clock_offsets(docs, shifts)
    events: list[dict[str, Any]] = []
    for rank, doc in docs.items():
        shift = shifts[rank] + offsets[rank]
        processes, threads = _thread_names(doc)
        tids: dict[tuple[Any, Any], int] = {}
        for e in doc["traceEvents"]:
            if e.get("ph") == "M":
                continue  # renamed below, one process per rank
            key = (e.get("pid"), e.get("tid"))
            if key not in tids:
                tids[key] = len(tids) + 1
            e = {**e, "pid": rank, "tid": tids[key]}
            if isinstance(e.get("ts"), int | float):
                e["ts"] = e["ts"] + shift
            if e.get("ph") in ("s", "t", "f") and isinstance(e.get("id"), int):
                e["id"] = (rank << 32) + e["id"]  # flow arrows pair within their rank
            events.append(e)
        label = f"rank {rank} ({host_of(doc)})"
        events.append(_meta("process_name", rank, 0, {"name": label}))
        events.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        for (pid, tid), new in tids.items():
            where = threads.get((pid, tid)) or f"thread {tid}"
            owner = processes.get(pid, "")
            name = where if owner in ("", "python") or owner in where else f"{owner} {where}"
            events.append(_meta("thread_name", rank, new, {"name": name}))
            events.append(_meta("thread_sort_index", rank, new, {"sort_index": new}))
    merged = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base,
        "cumulus": {
            "ranks": {
                str(r): {"host": host_of(d), "clock_offset_us": offsets[r]} for r, d in docs.items()
            }
        },
    }
    tmp = out.with_name(f".{out.name}.tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=5) as f:  # 9: 3x slower
        json.dump(merged, f, separators=(",", ":"))
    os.replace(tmp, out)
    return out


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "ts": 0, "args": args}


def phase_lanes(timeline: Path | dict[str, Any]) -> dict[int, dict[str, list[Span]]]:
    """Each rank's spans of a merged timeline (a file, or one loaded): `steps` ("step N") and
    `phases` (data, compute, sync, optimizer, checkpoint, eval), as (name, start, end) in µs."""
    doc = load_trace(timeline) if isinstance(timeline, Path) else timeline
    lanes: dict[int, dict[str, list[Span]]] = {}
    for e in annotations(doc):
        name, rank = str(e["name"]), e.get("pid")
        if not isinstance(rank, int):
            continue
        lane = lanes.setdefault(rank, {"steps": [], "phases": []})
        span = (name, float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        if name.startswith("step "):
            lane["steps"].append(span)
        elif name.split(" ", 1)[0] in PHASES:
            lane["phases"].append(span)
    return lanes
