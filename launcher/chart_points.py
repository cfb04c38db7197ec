"""What a run's charts show, read from its run directory as the workers write it (`RunFollower`): each
`metrics.jsonl` line as `train/*` (and `eval/val_loss`), with `train/goodput` so far, and each failure (with the
recoveries from it) and each move (a drain, a straggler's rank handed to a spare) at its step, as `ft/time_lost_s` and
the text `ft/events`, worded as the console describes them (`launcher.summary.describe_recoveries`).

Goodput so far, at step N: (N - the first step) x the median `step_s` of the metrics lines so far / (when N was first
committed - the first `train_start`): the goodput report's definition (`launcher.goodput`), with the median step
time taken from the metrics.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from launcher.summary import describe_recoveries, failures, moves, recoveries, restarts, stragglers

METRIC_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "step_s": "train/step_s",
    "world_size": "train/world_size",
    "peak_memory_gib": "train/peak_memory_gib",
    "val_loss": "eval/val_loss",
}
"""`metrics.jsonl` field -> chart tag."""
GOODPUT_TAG = "train/goodput"
TIME_LOST_TAG = "ft/time_lost_s"
EVENTS_TAG = "ft/events"
KEPT_EVENTS = {
    "train_start",
    "failure_detected",
    "recovery_phase",
    "frozen_base",
    "move_started",
    "straggler_detected",
    "torchrun_started",
    "worker_start",
    "worker_exited",
    "fault_injected",
    "checkpoint_loaded",
}
"""What `launcher.summary` reads to describe failures, recoveries (torchrun's restarts too) and moves; of the
`step_committed` events, `_Commits` keeps the few it needs."""


@dataclass(frozen=True)
class FtEntry:
    """A failure (with the recoveries from it) or a move, as the charts show it."""

    key: str
    """Names it among the run's entries (its text's first line): what a backend reads back to write it once."""
    step: int
    """The step it struck (a failure: the interrupted step; a move: the step after which the ranks moved)."""
    time_lost_s: float
    """Failure to the interrupted step committed again (only the detection while it never was); a move's rebuild
    and transfer."""
    text: str


class RunFollower:
    """Reads a run directory as it grows: each `poll` returns the metrics lines written since the last one (each with
    its goodput so far) and the ft entries whose figures became final."""

    def __init__(self, run_dir: Path) -> None:
        self.metrics = _JsonLines(run_dir / "metrics.jsonl")
        self.events_dir = run_dir / "events"
        self.event_files: dict[Path, _JsonLines] = {}
        self.kept: list[dict] = []
        self.commits = _Commits()
        self.first_start: dict | None = None
        self.committed_at: dict[int, float] = {}
        self.step_times: list[float] = []
        self.progress = 0
        self.pending = False
        self.emitted: set[str] = set()

    def poll(self, *, ended: bool) -> tuple[list[tuple[int, dict[str, float]]], list[FtEntry]]:
        """New points (step, tag -> value) and new final ft entries; `ended`: the job ended, every entry is final."""
        settled = self.progress
        lines = self.metrics.read_new()  # before the events: rank 0 wrote each line's commit event before the line
        news = sum(self._note(event) for event in self._read_events())
        points = [(line["step"], self._values(line)) for line in lines]
        if points:
            done = points[-1][0]
            self.committed_at = {step: t for step, t in self.committed_at.items() if step > done}
        if not (news or ended or self.pending):
            return points, []
        # An entry's figures are final once a later step than its own was committed before this poll began (every
        # member of its generation wrote its phases before that), or once the job ended.
        entries = ft_entries(self._ft_events())
        final = [e for e in entries if ended or settled > e.step]
        self.pending = len(final) < len(entries)
        new = [e for e in final if e.key not in self.emitted]
        self.emitted.update(e.key for e in new)
        return points, new

    def _read_events(self) -> Iterator[dict]:
        for path in sorted(self.events_dir.glob("*.jsonl")):
            yield from self.event_files.setdefault(path, _JsonLines(path)).read_new()

    def _note(self, event: dict) -> bool:
        """Keep what the charts need of `event`; whether it was an ft event."""
        kind = event.get("event")
        if kind == "step_committed":
            self.progress = max(self.progress, event["step"])
            self.committed_at[event["step"]] = min(event["t"], self.committed_at.get(event["step"], event["t"]))
        if kind in ("step_committed", "worker_start"):
            self.commits.add(event)
        if kind == "train_start" and (self.first_start is None or event["t"] < self.first_start["t"]):
            self.first_start = event
        if kind not in KEPT_EVENTS:
            return False
        self.kept.append(event)
        return True

    def _ft_events(self) -> list[dict]:
        return sorted(self.kept + self.commits.events(), key=lambda e: e["t"])

    def _values(self, line: dict) -> dict[str, float]:
        values = {tag: float(line[name]) for name, tag in METRIC_TAGS.items() if line.get(name) is not None}
        if "step_s" in line:  # (an evaluation step's line may hold its validation loss alone)
            bisect.insort(self.step_times, line["step_s"])
        committed_at = self.committed_at.get(line["step"])
        start = self.first_start
        if self.step_times and start is not None and committed_at is not None and committed_at > start["t"]:
            steps = line["step"] - start.get("step", 0)
            values[GOODPUT_TAG] = steps * _median(self.step_times) / (committed_at - start["t"])
        return values


def ft_entries(events: list[dict]) -> list[FtEntry]:
    """The failures among `events` (in time order), grouped by the step they interrupted, each with the recoveries from
    it (torchrun's restarts), and the moves."""
    recovered = restarts(events) if any(e["event"] == "torchrun_started" for e in events) else recoveries(events)
    failed = failures(events)
    entries = []
    for step in sorted({f["step"] for f in failed} | {r["interrupted_step"] for r in recovered}):
        mine = [r for r in recovered if r["interrupted_step"] == step]
        done = [r["time_to_recover_s"] for r in mine if r["completed"]]
        lost = sum(done) if done else sum(r["detect_s"] for r in mine)
        lines = describe_recoveries({"failures": [f for f in failed if f["step"] == step], "recoveries": mine})
        entries.append(_entry(f"failure at step {step}", step, lost, lines))
    found = stragglers(events)
    for number, move in enumerate(moves(events), start=1):
        slow = {s["worker"]: s for s in found if s["moved"] and s["worker"] in move["workers"]}
        described = {"failures": [], "recoveries": [], "stragglers": list(slow.values()), "moves": [move]}
        lost = sum(move["time_s"].values()) if move["completed"] else 0.0
        step = move["after_step"]
        entries.append(_entry(f"move {number} at step {step}", step, lost, describe_recoveries(described)))
    return entries


def _entry(key: str, step: int, time_lost_s: float, lines: list[str]) -> FtEntry:
    return FtEntry(key=key, step=step, time_lost_s=time_lost_s, text="\n".join([key, *lines]))


class _JsonLines:
    """A JSON-lines file read as it grows: each call, the complete objects appended since the last (a torn line, a
    crash mid-write, is skipped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read_new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return [r for r in records if isinstance(r, dict)]


class _Commits:
    """Of the `step_committed` events, those `summary.failures` and `summary.restarts` read (a torchrun restart
    appends to the same worker's file): per worker and start, its first commit past every step it committed before
    (the interrupted step, replayed) and its latest. A few per worker, however long the run."""

    def __init__(self) -> None:
        self.kept: list[dict] = []
        self.best: dict[str, int] = {}
        self.passed: dict[str, dict] = {}
        self.latest: dict[str, dict] = {}

    def add(self, event: dict) -> None:
        name = event["worker"]
        if event["event"] == "worker_start":
            latest, passed = self.latest.pop(name, None), self.passed.pop(name, None)
            if latest is not None:
                self.best[name] = max(self.best.get(name, 0), latest["step"])
                if latest is not passed:
                    self.kept.append(latest)
            return
        if name not in self.passed and event["step"] > self.best.get(name, 0):
            self.passed[name] = event
            self.kept.append(event)
        self.latest[name] = event

    def events(self) -> list[dict]:
        return self.kept + [e for name, e in self.latest.items() if e is not self.passed.get(name)]


def _median(ordered: list[float]) -> float:
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
