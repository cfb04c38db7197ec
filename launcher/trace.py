"""A run's events as a Chrome trace (`chrome_trace`, `write_trace`): ui.perfetto.dev and chrome://tracing open it.

One process for the job (the coordinator, the launcher) and one per host (its agent, then its workers); a thread
track per process that wrote events, and one more for a worker's disk checkpoints (a background write overlaps
steps). Steps and recovery phases are complete events ("X") nested on their worker's track, the coordinator's
detections on its own; every other event is an instant ("i") on the track of the process that wrote it (an injected
fault: on the struck worker's), job-wide ("s": "g") for what befalls the whole job. Times are whole microseconds
since the run's first event; each entry's args are its event's fields.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB_WIDE = frozenset({"failure_detected", "host_lost", "job_abandoned", "coordinator_lost"})
"""Failures of the job, not of one process: global instants."""
FAILURES = JOB_WIDE | {
    "fault_injected",
    "failure_noticed",
    "worker_fenced",
    "worker_error",
    "spare_lost",
    "join_failed",
    "handover_failed",
    "handover_lost",
    "divergence_detected",
    "straggler_detected",
    "self_fenced",
    "coordinator_timeout",
    "checkpoint_failed",
}
"""Instants in the `failure` category (Perfetto filters by category)."""
CHECKPOINT_EVENTS = frozenset({"checkpoint_written", "checkpoint_loaded"})
JOB = "job"
UNPLACED = "workers"
"""The process of workers whose host no event names (torchrun's)."""
_NOT_ARGS = frozenset({"t", "event", "worker"})


@dataclass(frozen=True)
class _Entry:
    """One trace event before it is placed on a track: an instant when `end_t` is None."""

    name: str
    """What Perfetto labels it with: the event's name, `step N`, or the recovery phase's."""
    category: str
    """`step`, `recovery`, `checkpoint`, `failure`, `decision` (the coordinator's) or `lifecycle`."""
    track: str
    """The emitter (or `<worker> checkpoints`) whose track holds it."""
    start_t: float
    """Unix seconds."""
    end_t: float | None
    """Unix seconds; None for an instant."""
    event: dict[str, Any]
    """Where its args come from."""


@dataclass(frozen=True)
class _Track:
    """One thread track of the trace."""

    pid: int
    """Its process: the job's, or a host's."""
    tid: int
    """Unique over the whole trace."""
    process: str
    """The process's name: `job`, `host <name>`, or `workers` (host unknown)."""
    name: str
    """The thread's name: the emitter's, `(spare)` added for a worker started as a spare."""
    sort_index: int
    """Its place within its process."""


def chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome Trace Event Format object of a run's `events` (as `ckptless_core.events.read_events` returns them,
    in time order): `traceEvents` (track names first, then the entries in time order) and `displayTimeUnit`."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = events[0]["t"]
    by_emitter: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        by_emitter.setdefault(event["worker"], []).append(event)
    entries = [entry for mine in by_emitter.values() for entry in _entries(mine)]
    tracks = _tracks(events, sorted({entry.track for entry in entries}))
    trace = [_trace_event(entry, tracks[entry.track], t0=t0) for entry in entries]
    trace.sort(key=lambda e: (e["ts"], e["pid"], e["tid"], -e.get("dur", 0)))  # stable: ties stay as written
    return {"traceEvents": _metadata(tracks) + trace, "displayTimeUnit": "ms"}


def write_trace(events: list[dict[str, Any]], path: Path) -> Path:
    """Write `chrome_trace(events)` to `path` as JSON and return `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events), separators=(",", ":")) + "\n")
    return path


def _entries(mine: list[dict[str, Any]]) -> Iterator[_Entry]:
    """The entries of one process's events (in time order). Its steps never overlap each other, nor its recovery
    phases each other: each starts no earlier than the previous one ended (a duration is measured a moment before its
    event is written, on another clock for steps), so that Perfetto sees them nested."""
    step_end = phase_end = -math.inf
    starting: dict[str, Any] | None = None  # a `worker_start` whose worker is not ready yet
    for event, following in zip(mine, [*mine[1:], None], strict=True):
        kind, t, emitter = event["event"], event["t"], event["worker"]
        if kind == "step_committed":
            start, step_end = max(t - event.get("step_s", 0.0), step_end), t
            yield _Entry(f"step {event['step']}", "step", emitter, start, t, event)
        elif kind in ("recovery_phase", "handed_over"):
            start, end = _phase_span(event, following)
            start, phase_end = min(max(start, phase_end), end), end
            yield _Entry(event.get("phase", "hand over"), "recovery", emitter, start, end, event)
        elif kind == "worker_start":
            if starting is not None:
                yield _instant(starting)  # never ready: it died while starting
            starting = event
        elif kind == "worker_ready" and starting is not None:
            yield _Entry("startup", "lifecycle", emitter, starting["t"], t, starting)
            starting = None
        elif kind in CHECKPOINT_EVENTS:
            name = "checkpoint write" if kind == "checkpoint_written" else "checkpoint load"
            yield _Entry(name, "checkpoint", f"{emitter} checkpoints", t - event["duration_s"], t, event)
        else:
            yield _instant(event)
    if starting is not None:
        yield _instant(starting)


def _instant(event: dict[str, Any]) -> _Entry:
    """On the track of the process that wrote it; an injected fault on the struck worker's."""
    track = event["worker"]
    if event["event"] == "fault_injected":
        track = event.get("worker_name") or track
    return _Entry(event["event"], _category(event), track, event["t"], None, event)


def _phase_span(phase: dict[str, Any], following: dict[str, Any] | None) -> tuple[float, float]:
    """When a recovery phase began and ended, in Unix seconds. Its event is written a moment after it ended: a
    rebuild's together with its transfer (it ended where the transfer began); a replay's just before the replayed
    step's commit (drawn until the commit, the end of the step it replays)."""
    start, end = phase["t"] - phase["duration_s"], phase["t"]
    if phase.get("phase") == "rebuild" and _is(following, "recovery_phase", phase="transfer"):
        end = following["t"] - following["duration_s"]
        start = end - phase["duration_s"]
    elif phase.get("phase") == "replay" and _is(following, "step_committed", step=phase.get("step")):
        end = following["t"]
    return start, end


def _is(event: dict[str, Any] | None, kind: str, **fields: Any) -> bool:
    return event is not None and event["event"] == kind and all(event.get(k) == v for k, v in fields.items())


def _category(event: dict[str, Any]) -> str:
    if event["event"] in FAILURES:
        return "failure"
    return "decision" if event["worker"] == "coordinator" else "lifecycle"


def _tracks(events: list[dict[str, Any]], names: list[str]) -> dict[str, _Track]:
    """A track per name: the job's first (coordinator, launcher, then the rest), then each host's (its agent, then its
    workers by number, each followed by its checkpoints), then the workers of no known host."""
    hosts = {e["worker_name"]: e["host"] for e in events if e["event"] == "worker_started" and "host" in e}
    spares = {e["worker_name"] for e in events if e["event"] == "worker_started" and e.get("spare")}

    def place(name: str) -> tuple[str, tuple]:
        """(process, order within it)"""
        worker = name.removesuffix(" checkpoints")
        if worker.startswith("agent-"):
            return f"host {worker.removeprefix('agent-')}", (0, _natural(name))
        if worker.startswith("worker"):
            process = f"host {hosts[worker]}" if worker in hosts else UNPLACED
            return process, (1, _natural(worker), name != worker)
        return JOB, ({"coordinator": 0, "launcher": 1}.get(name, 2), _natural(name))

    placed = {name: place(name) for name in names}
    processes = sorted({process for process, _ in placed.values()}, key=_process_order)
    pids = {process: pid for pid, process in enumerate(processes, start=1)}
    ordered = sorted(names, key=lambda name: (pids[placed[name][0]], placed[name][1]))
    tracks, sort_index = {}, dict.fromkeys(pids, 0)
    for tid, name in enumerate(ordered, start=1):
        process = placed[name][0]
        label = f"{name} (spare)" if name in spares else name
        tracks[name] = _Track(pids[process], tid, process, label, sort_index[process])
        sort_index[process] += 1
    return tracks


def _process_order(process: str) -> tuple:
    return (process != JOB, process == UNPLACED, _natural(process))


def _natural(name: str) -> list[str | int]:
    """worker2 before worker10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _metadata(tracks: dict[str, _Track]) -> list[dict[str, Any]]:
    """The names and order of the processes and threads."""
    result = []
    processes = {t.pid: t.process for t in tracks.values()}
    for pid, process in sorted(processes.items()):
        result += [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        ]
    for t in sorted(tracks.values(), key=lambda t: t.tid):
        result += [
            {"name": "thread_name", "ph": "M", "pid": t.pid, "tid": t.tid, "args": {"name": t.name}},
            {"name": "thread_sort_index", "ph": "M", "pid": t.pid, "tid": t.tid, "args": {"sort_index": t.sort_index}},
        ]
    return result


def _trace_event(entry: _Entry, track: _Track, *, t0: float) -> dict[str, Any]:
    start_us = _microseconds(entry.start_t - t0)
    result = {"name": entry.name, "cat": entry.category, "pid": track.pid, "tid": track.tid, "ts": start_us}
    if entry.end_t is None:
        result |= {"ph": "i", "s": "g" if entry.event["event"] in JOB_WIDE else "t"}
    else:
        result |= {"ph": "X", "dur": _microseconds(entry.end_t - t0) - start_us}
    result["args"] = {k: v for k, v in entry.event.items() if k not in _NOT_ARGS and v is not None}
    return result


def _microseconds(seconds: float) -> int:
    """Whole microseconds, so that two entries ending at the same moment end at the same number (Perfetto drops a
    slice that overlaps its parent's end by even a nanosecond)."""
    return max(0, round(seconds * 1e6))
