"""What the supervisor is asked to run (`JobSpec`, with its `FaultToleranceSpec`) and what it reports back."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptless_core.faults import FaultEvent


@dataclass
class FaultToleranceSpec:
    enabled: bool = False
    """Recover from failures; when False any failure ends the job."""
    spares: int = 0
    """Hot spares kept ready beside the workers."""
    heartbeat_timeout_s: float = 10.0
    """A worker silent this long is declared hung, fenced (SIGKILL) and replaced."""
    on_no_spare: str = "shrink"
    """Without a ready spare: `shrink` (continue with fewer ranks), `wait` (for a new spare), `fail`."""
    max_failures_without_progress: int = 3
    """End the job when this many failures follow each other with no step committed in between."""
    world_sizes: tuple[int, ...] = ()
    """World sizes the job can run at (the global batch must divide); empty: any."""
    settle_s: float = 0.3
    """How long a reported collective error waits for a process failure that explains it."""


@dataclass
class JobSpec:
    entry: str
    """`package.module:function` each worker calls (no arguments; it reads its environment)."""
    nproc: int
    """Worker processes to start (data-parallel ranks)."""
    run_dir: Path
    """The run directory: `logs/<worker>.log` and `events/<worker>.jsonl` go here."""
    preload: Sequence[str] = ()
    """Modules the fork server imports once before forking workers."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every worker."""
    threads_per_worker: int = 1
    """torch intra-op threads in each worker."""
    store_timeout_s: float = 300.0
    """Timeout of the coordination store's waits."""
    ft: FaultToleranceSpec = field(default_factory=FaultToleranceSpec)
    """Fault tolerance: spares, detection, policies."""
    faults: list[FaultEvent] = field(default_factory=list)
    """Faults to inject (tests, demos, benchmarks)."""


@dataclass
class JobOutcome:
    ok: bool
    """True when every member exited with code 0."""
    exit_codes: dict[str, int]
    """Exit code per worker (negative: killed by that signal)."""
    message: str
    """What happened, for the console."""
    reason: str = "completed"
    """`completed`, `failed`, `no_progress` (repeated failures without a committed step), `interrupted`."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
