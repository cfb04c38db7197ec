"""When to write disk checkpoints: every N steps, or `auto`, the Young-Daly interval.

Young (1974) and Daly (2006): with a write cost of C seconds and a mean time between failures M, checkpointing every
sqrt(2 C M) seconds of work minimises the expected time lost to writes plus redone work. `auto` measures C (the
first write, made when training starts) and the step time (median of a few early steps), then fixes the interval in
steps; the decision is kept in `<checkpoint dir>/schedule.json`, so a restarted job keeps it instead of measuring again.

Every rank takes part in each checkpoint (each writes its own slices), so every rank must hold the same interval:
while it is undecided, each step agrees on it (`agree`: the largest proposal over the ranks, 0 from a rank with none
yet, as a newcomer), and all ranks adopt it at the same step.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path

from ckptless_core.events import EventLog

MEASURED_STEPS = 5
"""Step times the `auto` decision takes the median of (after the first step, which warms up)."""


def young_daly_interval_s(*, write_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * write_s * mtbf_s)


class CheckpointSchedule:
    def __init__(self, every: int | str, *, mtbf_s: float, directory: Path, events: EventLog) -> None:
        self.mtbf_s = mtbf_s
        self.path = directory / "schedule.json"
        self.events = events
        self.every_steps: int | None = every if isinstance(every, int) else None
        """Steps between writes; None while `auto` is still measuring."""
        self.write_s: float | None = None
        self.step_times_s: list[float] = []
        self.proposal: dict | None = None
        """This rank's `auto` decision, until the ranks agree on one."""
        if self.every_steps is None and self.path.is_file():
            self.every_steps = int(json.loads(self.path.read_text())["every_steps"])

    @property
    def needs_write_cost(self) -> bool:
        """`auto` has not measured a write yet: write one now (at the current step) to measure it."""
        return self.every_steps is None and self.write_s is None

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def observe_write(self, write_s: float) -> None:
        if self.write_s is None:
            self.write_s = write_s

    def observe_step(self, step_s: float) -> None:
        """Record a step's duration; once enough are seen, `auto` proposes the interval (see `agree`)."""
        if self.every_steps is not None or self.write_s is None or self.proposal is not None:
            return
        self.step_times_s.append(step_s)
        if len(self.step_times_s) < MEASURED_STEPS + 1:
            return
        step_s = statistics.median(self.step_times_s[1:])
        interval_s = young_daly_interval_s(write_s=self.write_s, mtbf_s=self.mtbf_s)
        self.proposal = {
            "every_steps": max(1, round(interval_s / step_s)),
            "interval_s": interval_s,
            "write_s": self.write_s,
            "step_s": step_s,
            "mtbf_s": self.mtbf_s,
        }

    def agree(self, agree_max: Callable[[int], int]) -> None:
        """While `auto` is undecided, every rank calls this in every step (inside the step: a failure replays it
        with the step): `agree_max` returns the largest of the ranks' proposals, and a nonzero one becomes the
        interval of all of them (a rank that joined after the decision reads it from schedule.json)."""
        if self.every_steps is not None:
            return
        if self.path.is_file():
            self.every_steps = int(json.loads(self.path.read_text())["every_steps"])
            return
        agreed = agree_max(self.proposal["every_steps"] if self.proposal else 0)
        if not agreed:
            return
        self.every_steps = agreed
        decision = {**(self.proposal or {}), "every_steps": agreed}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")  # every rank writes the same decision
        tmp.write_text(json.dumps(decision) + "\n")
        os.replace(tmp, self.path)
        self.events.emit("checkpoint_schedule", **decision)
