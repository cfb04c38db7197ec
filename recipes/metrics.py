"""`metrics.jsonl`: one JSON object per logged step, written by whichever worker holds rank 0 (its values are
already global). The rank-0 role can move to another worker in a recovery; a step appears at most once."""

from __future__ import annotations

import json
from pathlib import Path

from ckptless_core.events import read_jsonl


class MetricsLog:
    def __init__(self, path: Path, *, every: int, max_steps: int) -> None:
        self.path = path
        self.every = every
        self.max_steps = max_steps
        self.file = None
        self.last_step = 0

    def log(self, step: int, **values: float) -> None:
        """Record `step` (1-based, committed) if it falls on the cadence or is the last one, and is new."""
        if step % self.every and step != self.max_steps:
            return
        if self.file is None:
            self._open()
        if step <= self.last_step:
            return  # logged by the previous rank 0 before it failed; the replay reproduced the same values
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        self.last_step = step

    def _open(self) -> None:
        self.last_step = max((r.get("step", 0) for r in read_jsonl(self.path)), default=0)
        if self.path.exists() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            with open(self.path, "a") as torn:
                torn.write("\n")  # end a line torn by a crash, so the next record starts on its own line
        self.file = open(self.path, "a")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
