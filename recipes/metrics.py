"""`metrics.jsonl`: one JSON object per logged step, written by rank 0 only (its values are already global)."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path, *, every: int, max_steps: int, enabled: bool) -> None:
        self.every = every
        self.max_steps = max_steps
        self.file = open(path, "a") if enabled else None

    def log(self, step: int, **values: float) -> None:
        """Record `step` (1-based, committed) if it falls on the cadence or is the last one."""
        if self.file is None or (step % self.every and step != self.max_steps):
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
