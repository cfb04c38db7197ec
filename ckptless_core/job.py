"""What the coordinator is asked to run (`JobSpec`, with its `FaultToleranceSpec`) and what it reports back."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ckptless_core.faults import FaultEvent, signal_name


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
    """World sizes the job can run at (the global batch must divide, into whole replica groups); empty: any."""
    shard: int = 1
    """Ranks one copy of the state is sharded over (`layout.Layout`): a shrink keeps whole replica groups."""
    settle_s: float = 0.3
    """How long a reported collective error waits for a process failure that explains it."""
    host_timeout_s: float = 2.0
    """A host whose agent is silent this long is lost with every process on it (the coordinator's clock)."""
    stall_timeout_s: float = 10.0
    """A step in which some rank has waited this long inside the collective for ranks that do not arrive (alive
    but stuck) blames those ranks: they are fenced and replaced."""
    progress_deadline_s: float = 600.0
    """No committed step for this long ends the job (exit 4), naming the ranks that did not arrive."""
    coordinator_timeout_s: float = 60.0
    """Agents keep their workers this long without a coordinator (it died and is being restarted), then stop."""
    lease_s: float = 1.5
    on_straggler: str = "off"
    """`replace` (move a straggler's rank to a ready spare), `report`, or `off` (`stragglers`)."""
    straggler_factor: float = 1.5
    straggler_window_steps: int = 20
    drain_grace_s: float = 60.0
    """`on_no_spare=wait`: how long a leaving host keeps training for a spare to be ready before the job shrinks."""
    drain_timeout_s: float = 120.0
    """A leaving host's agent goes after this long even if its ranks were not handed over."""
    """A host that hears nothing from the coordinator this long while its workers commit no step fences them
    itself (cut off: its ranks are about to be replaced); below `host_timeout_s`."""


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
    num_hosts: int = 1
    """Training hosts: their agents (sorted by host name, first) get `nproc / num_hosts` workers each, in rank
    order."""
    spare_hosts: int = 0
    """Hosts of spares only, `nproc / num_hosts` each; the job waits for `num_hosts + spare_hosts` agents."""
    config_sha256: str = ""
    """SHA-256 of the run's config file: an agent started with another run directory's config is refused."""

    def save(self, path: Path) -> None:
        """As JSON, written whole or not at all: what a coordinator process (first or restarted) runs."""
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(self), default=str, indent=1))
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path) -> JobSpec:
        record = json.loads(path.read_text())
        record["run_dir"] = Path(record["run_dir"])
        record["ft"] = FaultToleranceSpec(**{**record["ft"], "world_sizes": tuple(record["ft"]["world_sizes"])})
        record["faults"] = [FaultEvent(**event) for event in record["faults"]]
        return cls(**record)


WORKER_EXIT_TRAINING_CODE_ERROR = 5
"""A worker's exit code when its training code raised the same error again on the replay of a step."""


@dataclass
class JobOutcome:
    ok: bool
    """True when every member exited with code 0."""
    exit_codes: dict[str, int]
    """Exit code per worker (negative: killed by that signal)."""
    message: str
    """What happened, for the console."""
    reason: str = "completed"
    """`completed`, `failed`, `no_progress` (repeated failures without a committed step), `training_code_error` (the
    training code raised the same error again after a replay), `stopped`."""
    error: str = ""
    """The traceback of a `training_code_error`."""

    def save(self, path: Path) -> None:
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(self)))
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path) -> JobOutcome:
        return cls(**json.loads(path.read_text()))


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exit code {code}"
