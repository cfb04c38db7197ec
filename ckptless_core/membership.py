"""Membership and generations, kept in the supervisor's c10d store.

The supervisor is the only writer of a generation: which worker holds which rank, and the world size. Workers
read it, report heartbeats, progress and failures under keys of their own; every report carries the generation
it was made in, so a report from a fenced or stale worker is recognised and ignored.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field

import torch.distributed as dist

GENERATION_KEY = "generation"
GENERATION_NUMBER_KEY = "generation_number"
STOP_KEY = "stop"
"""Set by the supervisor on a stop request: the committed step at which every worker stops."""
NEW_GENERATION_SIGNAL = signal.SIGURG
"""Sent by the supervisor to the members of a generation it publishes after the first (ignored by default)."""
"""Set by the supervisor to ask every worker for a clean stop at its next step boundary."""


@dataclass(frozen=True)
class Generation:
    number: int
    """Increases with every membership change; generation g's process group lives under store prefix `gen<g>`."""
    members: dict[str, int] = field(default_factory=dict)
    """Worker name -> data-parallel rank."""
    reason: str = "start"
    """Why it began: `start`, `failure`, `grow`."""

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def store_prefix(self) -> str:
        return f"gen{self.number}"

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": self.members, "reason": self.reason})

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        record = json.loads(text)
        return cls(number=int(record["number"]), members=dict(record["members"]), reason=record["reason"])


def publish_generation(store: dist.Store, generation: Generation) -> None:
    """Supervisor only: the record first, then the number workers poll, so a reader never sees a newer number
    than the record."""
    store.set(GENERATION_KEY, generation.to_json())
    store.set(GENERATION_NUMBER_KEY, str(generation.number))


def current_generation_number(store: dist.Store) -> int:
    """Cheap enough for every step: one small key."""
    return int(store.get(GENERATION_NUMBER_KEY))


def read_generation(store: dist.Store) -> Generation:
    return Generation.from_json(store.get(GENERATION_KEY))


def wait_for_generation(store: dist.Store, *, newer_than: int, timeout_s: float, poll_s: float = 0.01) -> Generation:
    """Block until the supervisor publishes a generation newer than `newer_than`; bounded by `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if current_generation_number(store) > newer_than:
            return read_generation(store)
        time.sleep(poll_s)
    raise TimeoutError(f"no generation after {newer_than} within {timeout_s:.0f} s: is the supervisor alive?")


def report(store: dist.Store, topic: str, worker: str, **fields) -> None:
    """A worker's report under `<topic>/<worker>` (heartbeat, progress, failure, ready, source)."""
    store.set(f"{topic}/{worker}", json.dumps({"t": time.time(), **fields}))


def read_reports(store: dist.Store, topic: str, workers: list[str]) -> dict[str, dict]:
    """The latest `<topic>` report of each worker that has one."""
    keys = [f"{topic}/{w}" for w in workers]
    present = [k for k in keys if store.check([k])]
    if not present:
        return {}
    values = store.multi_get(present)
    return {k.split("/", 1)[1]: json.loads(v) for k, v in zip(present, values, strict=True)}
