"""A run's timeline: what each worker was doing when (`timeline`), and the picture of it (`plot_timeline`).

One row per worker process name, built from the events by a small state machine per row. Checkpointless runs (a
coordinator) and the torchrun checkpoint-restart baseline (`torchrun_started`, several attempts per row) differ in how a
failure plays out, so each has its own event handler; the write intervals of checkpoints are laid over the rows last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.summary import AttemptNumbers

STARTING = "starting"
TRAINING = "training"
CHECKPOINTING = "checkpointing"
RECOVERING = "recovering"
REDOING = "redoing"
IDLE_SPARE = "idle spare"
HUNG = "hung"
DEAD = "dead"
FINISHED = "finished"

STATE_COLOURS = {
    STARTING: "#a6cee3",
    TRAINING: "#33a02c",
    CHECKPOINTING: "#1f78b4",
    RECOVERING: "#ff7f00",
    REDOING: "#fdbf6f",
    IDLE_SPARE: "#cab2d6",
    HUNG: "#6a3d9a",
    DEAD: "#3f3f3f",
    FINISHED: "#e0e0e0",
}
"""A fixed colour per state, in legend order."""

FAULT_COLOUR = "#e31a1c"
LIVE = (STARTING, TRAINING, RECOVERING, REDOING)
"""States in which a torchrun worker is caught up by a failure of its attempt."""


@dataclass
class Segment:
    """One stretch of a row in one state."""

    start_s: float
    """Seconds since the run's first event."""
    end_s: float
    """Seconds since the run's first event (exclusive)."""
    state: str
    """One of `STATE_COLOURS`."""


@dataclass
class _Row:
    """The state machine of one worker row: `enter` closes the current segment and opens the next."""

    spare: bool = False
    """Started as a hot spare (ckptless)."""
    attempt: int = 0
    """The torchrun attempt of the row's current process."""
    state: str | None = None
    """The current state; None before the row's first event."""
    since_s: float = 0.0
    """When the current state began."""
    segments: list[Segment] = field(default_factory=list)
    """The closed segments, in order."""
    writes: list[tuple[float, float]] = field(default_factory=list)
    """Checkpoint write intervals (start_s, end_s), laid over the segments at the end."""
    redo_until: int = 0
    """Torchrun: the step whose commit ends `redoing` (the step interrupted by the failure)."""

    def enter(self, state: str, at_s: float) -> None:
        if state == self.state:
            return
        if self.state is not None and at_s > self.since_s:
            self.segments.append(Segment(self.since_s, at_s, self.state))
        self.state, self.since_s = state, max(at_s, self.since_s)

    def close(self, end_s: float) -> list[Segment]:
        """The row's segments up to `end_s` (the run's last event), checkpoint writes laid over them."""
        if self.state is not None and end_s > self.since_s:
            self.segments.append(Segment(self.since_s, end_s, self.state))
        self.state = None
        return _merge(_overlay(self.segments, self.writes, CHECKPOINTING))


def timeline(events: list[dict[str, Any]]) -> dict[str, list[Segment]]:
    """Each worker's segments (ordered, not overlapping, from its first event to the run's last), keyed by worker
    name in numeric order. `events` as `ckptless_core.events.read_events` returns them (sorted by time)."""
    if not events:
        return {}
    t0 = events[0]["t"]
    torchrun = any(e["event"] == "torchrun_started" for e in events)
    handle = _TorchrunRows() if torchrun else _CkptlessRows()
    for event in events:
        handle(event, event["t"] - t0)
    end_s = events[-1]["t"] - t0
    return {name: handle.rows[name].close(end_s) for name in sorted(handle.rows, key=_name_order)}


class _CkptlessRows:
    """Rows of a supervised run: processes never come back, spares take over vacant ranks."""

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}

    def row(self, name: str) -> _Row:
        return self.rows.setdefault(name, _Row())

    def __call__(self, event: dict[str, Any], at_s: float) -> None:
        kind = event["event"]
        if event["worker"] == "coordinator":
            if "worker_name" not in event:
                return
            row = self.row(event["worker_name"])
            if kind == "worker_started":
                row.spare = bool(event.get("spare"))
                if row.state is None:
                    row.enter(STARTING, at_s)
            elif row.state == DEAD:
                return
            elif kind == "fault_injected" and event.get("signal") in ("SIGKILL", "SIGSTOP"):
                row.enter(DEAD if event["signal"] == "SIGKILL" else HUNG, at_s)
            elif kind in ("worker_fenced", "spare_lost") or (
                kind == "failure_detected" and event.get("kind") in ("exit", "hang")
            ):
                row.enter(DEAD, at_s)
            elif kind == "spare_promoted":
                row.enter(RECOVERING, at_s)
            return
        if not event["worker"].startswith("worker"):
            return
        row = self.row(event["worker"])
        if row.state in (DEAD, HUNG) and kind != "worker_error":
            return  # a stopped process's late lines (none expected) change nothing
        if kind == "worker_start" and row.state is None:
            row.enter(STARTING, at_s)
        elif kind == "worker_ready" and row.spare and row.state == STARTING:
            row.enter(IDLE_SPARE, at_s)
        elif kind == "joined" and row.state == IDLE_SPARE:
            row.enter(TRAINING, at_s)  # taken back by a grown job: a planned change, not a recovery
        elif kind == "train_start" and row.state == STARTING:
            row.enter(TRAINING, at_s)
        elif kind == "failure_noticed":
            row.enter(RECOVERING, at_s)
        elif kind == "demoted_to_spare":
            row.enter(IDLE_SPARE, at_s)
        elif row.state == RECOVERING and (
            kind == "step_committed" or (kind == "recovery_phase" and event.get("phase") == "replay")
        ):
            row.enter(TRAINING, at_s)
        elif kind in ("train_end", "stopped"):
            row.enter(FINISHED, at_s)
        elif kind == "worker_error":
            row.enter(DEAD, at_s)
        elif kind == "checkpoint_written":
            row.writes.append((at_s - event.get("duration_s", 0.0), at_s))


class _TorchrunRows:
    """Rows of the checkpoint-restart baseline: a failure stops every process of the attempt; torchrun restarts
    them all, they load the latest checkpoint and redo the steps since."""

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}
        self.last_step: dict[int, int] = {}
        """The highest step committed in each attempt."""
        self.failed: set[int] = set()
        """Attempts a failure already ended."""
        self.attempts = AttemptNumbers()

    def row(self, name: str) -> _Row:
        return self.rows.setdefault(name, _Row())

    def __call__(self, event: dict[str, Any], at_s: float) -> None:
        event = self.attempts.tag(event)
        kind = event["event"]
        if event["worker"] == "launcher":
            if kind not in ("fault_injected", "worker_exited"):
                return
            row = self.row(event["worker_name"])
            if event.get("attempt", row.attempt) != row.attempt or row.state in (FINISHED, DEAD):
                return  # a normal exit after train_end, or news about an earlier process of this row
            if kind == "worker_exited" or event.get("signal") == "SIGKILL":
                row.enter(DEAD, at_s)
            elif event.get("signal") == "SIGSTOP":
                row.enter(HUNG, at_s)
            self._fail_attempt(row.attempt, at_s)
            return
        if not event["worker"].startswith("worker"):
            return
        row = self.row(event["worker"])
        if kind == "worker_start":
            row.attempt = int(event.get("attempt", 0))
            row.enter(RECOVERING if row.attempt else STARTING, at_s)  # a restart: build, load, rendezvous
        elif row.state in (DEAD, HUNG):
            return
        elif kind == "train_start":
            interrupted = max((s for a, s in self.last_step.items() if a < row.attempt), default=-1) + 1
            row.redo_until = interrupted
            row.enter(REDOING if row.state == RECOVERING and interrupted > event.get("step", 0) else TRAINING, at_s)
        elif kind == "step_committed":
            self.last_step[row.attempt] = max(self.last_step.get(row.attempt, 0), event["step"])
            if row.state == REDOING and event["step"] >= row.redo_until:
                row.enter(TRAINING, at_s)
        elif kind in ("train_end", "stopped"):
            row.enter(FINISHED, at_s)
        elif kind == "worker_error":
            row.enter(DEAD, at_s)
            self._fail_attempt(row.attempt, at_s)
        elif kind == "checkpoint_written":
            row.writes.append((at_s - event.get("duration_s", 0.0), at_s))

    def _fail_attempt(self, attempt: int, at_s: float) -> None:
        """The first failure of an attempt: every other live process of it is now waiting to be torn down."""
        if attempt in self.failed:
            return
        self.failed.add(attempt)
        for row in self.rows.values():
            if row.attempt == attempt and row.state in LIVE:
                row.enter(RECOVERING, at_s)


def _overlay(segments: list[Segment], intervals: list[tuple[float, float]], state: str) -> list[Segment]:
    """`segments` with `state` laid over the parts inside `intervals` (but never over dead or hung stretches)."""
    out = segments
    for lo, hi in intervals:
        carved: list[Segment] = []
        for seg in out:
            a, b = max(seg.start_s, lo), min(seg.end_s, hi)
            if a >= b or seg.state in (DEAD, HUNG):
                carved.append(seg)
                continue
            if seg.start_s < a:
                carved.append(Segment(seg.start_s, a, seg.state))
            carved.append(Segment(a, b, state))
            if b < seg.end_s:
                carved.append(Segment(b, seg.end_s, seg.state))
        out = carved
    return out


def _merge(segments: list[Segment]) -> list[Segment]:
    """Adjacent segments in the same state become one."""
    merged: list[Segment] = []
    for seg in segments:
        if merged and merged[-1].state == seg.state and merged[-1].end_s >= seg.start_s:
            merged[-1] = Segment(merged[-1].start_s, seg.end_s, seg.state)
        else:
            merged.append(seg)
    return merged


def _name_order(name: str) -> tuple[str, int]:
    """worker2 before worker10."""
    stem = name.rstrip("0123456789")
    return stem, int(name[len(stem) :] or -1)


def plot_timeline(events: list[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Draw `timeline(events)` as a PNG (one bar row per worker, a colour per state, red lines at injected faults)
    and return `path`."""
    import matplotlib

    matplotlib.use("Agg")  # headless: runs write pictures, never open windows
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = timeline(events)
    if not rows:
        raise ValueError("no worker events to draw: is this the events/ folder of a run that started?")
    t0 = events[0]["t"]
    spares = {e["worker_name"] for e in events if e["event"] == "worker_started" and e.get("spare")}
    names = list(rows)
    figure, axes = plt.subplots(figsize=(10, 1.6 + 0.5 * len(names)))
    for y, name in enumerate(names):
        for state, colour in STATE_COLOURS.items():
            spans = [(s.start_s, s.end_s - s.start_s) for s in rows[name] if s.state == state]
            if spans:
                axes.broken_barh(spans, (y - 0.35, 0.7), facecolors=colour)
    faults = [e for e in events if e["event"] == "fault_injected"]
    for fault in faults:
        axes.axvline(fault["t"] - t0, color=FAULT_COLOUR, linestyle="--", linewidth=1.2)
    axes.set_yticks(range(len(names)), [f"{n} (spare)" if n in spares else n for n in names])
    axes.set_ylim(len(names) - 0.5, -0.5)  # worker0 on top
    axes.set_xlim(0, events[-1]["t"] - t0)
    axes.set_xlabel("seconds since the run started")
    axes.grid(True, axis="x", alpha=0.3)
    if title:
        axes.set_title(title)
    present = {s.state for segments in rows.values() for s in segments}
    handles: list[Any] = [Patch(color=c, label=s) for s, c in STATE_COLOURS.items() if s in present]
    if faults:
        handles.append(Line2D([], [], color=FAULT_COLOUR, linestyle="--", label="fault injected"))
    legend_rows = math.ceil(len(handles) / 5)
    figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), frameon=False)
    # Leave room at the bottom for the legend (about a quarter inch a line).
    figure.tight_layout(rect=(0, (0.1 + 0.25 * legend_rows) / figure.get_figheight(), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
