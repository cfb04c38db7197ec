"""Structured event log: one JSON object per line, appended by each process to a file of its own."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class EventLog:
    """Appends events for one process; every line is a complete object with `t`, `event`, `worker`, `rank`."""

    def __init__(self, path: str | Path, *, worker: str, rank: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.worker = worker
        self.rank = rank
        # O_APPEND and one write per line: a crash can tear at most the last line, which readers skip.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        record = {"t": time.time(), "event": event, "worker": self.worker, "rank": self.rank, **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The complete JSON objects of a JSON-lines file; a torn or partial line (a crash mid-write) is skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            yield record


def read_events(events_dir: str | Path) -> list[dict[str, Any]]:
    """All events of a run directory's `events/` folder, ordered by time."""
    records = [r for path in sorted(Path(events_dir).glob("*.jsonl")) for r in read_jsonl(path)]
    return sorted(records, key=lambda r: r.get("t", 0.0))
