"""When to write disk checkpoints: every N steps, or `auto`, the Young-Daly interval.

Young (1974) and Daly (2006): with a write cost of C seconds and a mean time between failures M, checkpointing every
sqrt(2 C M) seconds of work minimises the expected time lost to writes plus redone work. `auto` measures C (the
first write, made when training starts) and the step time (median of a few early steps), then fixes the interval in
steps; the decision is kept in `<checkpoint dir>/schedule.json`, so a restarted job keeps it instead of measuring again.
"""

from __future__ import annotations

import json
import math
import os
import statistics
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
        """Record a step's duration; once enough are seen, `auto` fixes the interval."""
        if self.every_steps is not None or self.write_s is None:
            return
        self.step_times_s.append(step_s)
        if len(self.step_times_s) < MEASURED_STEPS + 1:
            return
        step_s = statistics.median(self.step_times_s[1:])
        interval_s = young_daly_interval_s(write_s=self.write_s, mtbf_s=self.mtbf_s)
        self.every_steps = max(1, round(interval_s / step_s))
        decision = {
            "every_steps": self.every_steps,
            "interval_s": interval_s,
            "write_s": self.write_s,
            "step_s": step_s,
            "mtbf_s": self.mtbf_s,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(decision) + "\n")
        os.replace(tmp, self.path)
        self.events.emit("checkpoint_schedule", **decision)
