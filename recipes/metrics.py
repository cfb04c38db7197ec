"""`metrics.jsonl`: one JSON object per logged step, written by whichever worker holds rank 0 (its values are
already global). The rank-0 role can move to another worker in a recovery; a step appears at most once.

An evaluation step's line waits for its validation loss (computed at the start of the next step): its values are
held beside the log, in `metrics.held.json`, so that a worker taking over rank 0 meanwhile completes the line."""

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
        """Record `step` (1-based, committed) if it falls on the cadence, is the last one or has a validation loss,
        and is new."""
        if step % self.every and step != self.max_steps and "val_loss" not in values:
            return
        if self.file is None:
            self._open()
        if step <= self.last_step:
            return  # logged by the previous rank 0 before it failed; the replay reproduced the same values
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        self.last_step = step

    def hold(self, step: int, **values: float) -> None:
        """Keep an evaluation step's values until `complete` adds its validation loss."""
        partial = self.held_path.with_suffix(".partial")
        partial.write_text(json.dumps({"step": step, **values}))
        partial.replace(self.held_path)

    def complete(self, step: int, *, val_loss: float | None) -> None:
        """Log evaluation step `step` with its held values (those of the worker that held rank 0 then) and its
        validation loss (None: stopped before its evaluation)."""
        held = json.loads(self.held_path.read_text()) if self.held_path.exists() else {}
        values = {k: v for k, v in held.items() if k != "step"} if held.get("step") == step else {}
        self.log(step, **values, **({} if val_loss is None else {"val_loss": val_loss}))
        self.held_path.unlink(missing_ok=True)

    @property
    def held_path(self) -> Path:
        return self.path.with_name("metrics.held.json")

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
