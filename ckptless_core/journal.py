"""The coordinator's journal: each decision it takes (a worker ordered, a generation published, a worker retired, a
host lost, a fault fired), appended to the run directory before anyone is told of it. A coordinator restarted in a
fresh process replays it, then learns the rest (who lives, who reached which step) from the agents.

    <run dir>/coordinator/journal.jsonl     {"op": "generation", "number": 3, "members": {...}, ...}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ckptless_core.events import read_jsonl


class Journal:
    """Appends one JSON object per decision, durably: a decision is on disk before it is acted on."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, op: str, **fields: Any) -> None:
        os.write(self._fd, (json.dumps({"op": op, **fields}) + "\n").encode())
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    """The decisions in the order they were taken; a line torn by the coordinator's death is skipped."""
    return list(read_jsonl(path))


def journal_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "coordinator" / "journal.jsonl"
