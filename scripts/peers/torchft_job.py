"""A torchft job on this machine, for `scripts/bench_peers.py`: a lighthouse, one process per replica group
(`torchft_train.py`), the kill schedule applied from outside, and every lost process restarted at once, as torchft
expects (a fresh process that rejoins the quorum and heals from a peer).

A scheduled kill is a SIGKILL of the group's process while the scheduled step is in progress, half a step after it
committed the step before (see `_Group.strike_delay_s`). A process that exits non-zero otherwise is a
crash; it is restarted too. Everything that happens lands in `RUN_DIR/events/` (the supervisor's own events in
`bench.jsonl`), where `peers.measure` reads it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ckptless_core.events import EventLog

TRAIN_SCRIPT = Path(__file__).with_name("torchft_train.py")
POLL_S = 0.002
READY_TIMEOUT_S = 120.0
FINISH_GRACE_S = 5.0
"""Once a group has trained every step, how long the others get to finish theirs. A restarted process that found no
peer to heal from (the others had finished) trains from scratch alone: it is stopped, not waited for."""


@dataclass(frozen=True)
class LighthouseSettings:
    """The lighthouse's options; the defaults are those of torchft's README command (`--min_replicas 1
    --quorum_tick_ms 100 --join_timeout_ms 10000`) and of the binary (a 5 s heartbeat timeout)."""

    heartbeat_timeout_ms: int = 5000
    """How long the lighthouse counts a replica alive after its last heartbeat."""
    join_timeout_ms: int = 10000
    """How long a quorum waits for replicas that heartbeat but have not asked to join."""
    quorum_tick_ms: int = 100
    min_replicas: int = 1


@dataclass
class _Group:
    """One replica group: its current process, and what the supervisor has read of that process's events."""

    index: int
    kills: list[int]
    """Scheduled steps not struck yet, in order."""
    incarnation: int = -1
    process: subprocess.Popen | None = None
    events: TextIO | None = None
    committed: int = 0
    seen_commits: list[float] = field(default_factory=list)
    """When the supervisor saw each of the process's commits (monotonic clock)."""
    strike_at: float | None = None
    ready: bool = False
    finished: bool = False

    def strike_delay_s(self) -> float:
        """Half the process's recent step time: a kill lands mid-step, when the survivor has joined the step's
        quorum and may be in its all-reduce, as in a real failure."""
        recent = self.seen_commits[-21:]
        intervals = [b - a for a, b in zip(recent, recent[1:], strict=False)]
        return 0.5 * statistics.median(intervals) if intervals else 0.0


def start_lighthouse(run_dir: Path, settings: LighthouseSettings) -> tuple[subprocess.Popen, str]:
    """The `torchft_lighthouse` binary on a free port; its log in `RUN_DIR/logs/lighthouse.log`."""
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    log = run_dir / "logs" / "lighthouse.log"
    command = [
        str(binary),
        "--bind",
        "[::]:0",
        "--min_replicas",
        str(settings.min_replicas),
        "--quorum_tick_ms",
        str(settings.quorum_tick_ms),
        "--join_timeout_ms",
        str(settings.join_timeout_ms),
        "--heartbeat_timeout_ms",
        str(settings.heartbeat_timeout_ms),
    ]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        found = re.search(r"listening on: http://[^:\s]+:(\d+)", log.read_text())
        if found:
            return process, f"http://127.0.0.1:{found.group(1)}"
        if process.poll() is not None:
            break
        time.sleep(0.01)
    process.kill()
    raise RuntimeError(f"torchft_lighthouse did not start; see {log}")


def run_torchft(
    run_dir: Path,
    *,
    groups: int,
    faults: list[dict],
    settings: LighthouseSettings,
    stock: bool,
    timeout_s: float,
) -> None:
    """Run the job whose `config.yaml` is in `run_dir` to its last step; `faults` as `bench_goodput.failure_schedule`
    makes them (rank r strikes group r % groups)."""
    for name in ("events", "logs"):
        (run_dir / name).mkdir(parents=True, exist_ok=True)
    bench = EventLog(run_dir / "events" / "bench.jsonl", worker="bench")
    lighthouse, address = start_lighthouse(run_dir, settings)
    bench.emit("lighthouse_start", address=address, **settings.__dict__)
    members = [_Group(g, kills=sorted(f["step"] for f in faults if f["rank"] % groups == g)) for g in range(groups)]
    arguments = ["--groups", str(groups), "--lighthouse", address, *(["--stock"] if stock else [])]
    try:
        for group in members:
            _launch(group, run_dir=run_dir, arguments=arguments, bench=bench)
        _wait_until_ready(members, run_dir=run_dir)
        (run_dir / "start").touch()
        deadline = time.monotonic() + timeout_s
        done_at = None
        while not all(group.finished for group in members):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the torchft job did not finish in {timeout_s:.0f} s; see {run_dir}/logs")
            if done_at is not None and time.monotonic() > done_at + FINISH_GRACE_S:
                _stop_unfinished(members, bench)
                break
            for group in (g for g in members if not g.finished):
                _tend(group, run_dir=run_dir, arguments=arguments, bench=bench)
                if group.finished:
                    done_at = done_at or time.monotonic()
            time.sleep(POLL_S)
        bench.emit("job_end")
    finally:
        for group in members:
            if group.process is not None and group.process.poll() is None:
                group.process.kill()
        lighthouse.kill()
        lighthouse.wait()
        bench.close()


def _launch(group: _Group, *, run_dir: Path, arguments: list[str], bench: EventLog) -> None:
    group.incarnation += 1
    log = run_dir / "logs" / f"group{group.index}.{group.incarnation}.log"
    command = [sys.executable, str(TRAIN_SCRIPT), str(run_dir), "--group", str(group.index), *arguments]
    command += ["--incarnation", str(group.incarnation)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    group.process = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    group.events, group.ready, group.committed, group.seen_commits = None, False, 0, []
    bench.emit("worker_launched", group=group.index, incarnation=group.incarnation, pid=group.process.pid)


def _tend(group: _Group, *, run_dir: Path, arguments: list[str], bench: EventLog) -> None:
    """Read the group's progress; strike it when its scheduled step is half done; restart it at once if it died."""
    _read_events(group, run_dir=run_dir)
    now = time.monotonic()
    if group.kills and group.strike_at is None and group.committed >= group.kills[0] - 1:
        group.strike_at = now + group.strike_delay_s()
    if group.strike_at is not None and now >= group.strike_at:
        group.process.send_signal(signal.SIGKILL)
        bench.emit("fault_injected", group=group.index, step=group.kills.pop(0), pid=group.process.pid)
        group.strike_at = None
    code = group.process.poll()
    if code == 0:
        group.finished = True
    elif code is not None:
        cause = "kill" if code == -signal.SIGKILL else "crash"
        bench.emit("worker_exited", group=group.index, code=code, cause=cause, committed=group.committed)
        _launch(group, run_dir=run_dir, arguments=arguments, bench=bench)


def _stop_unfinished(members: list[_Group], bench: EventLog) -> None:
    for group in members:
        if not group.finished:
            group.process.kill()
            group.process.wait()
            bench.emit("worker_stopped", group=group.index, committed=group.committed, reason="the others finished")
            group.finished = True


def _events_path(run_dir: Path, group: int, incarnation: int) -> Path:
    return run_dir / "events" / f"group{group}.{incarnation}.jsonl"


def _read_events(group: _Group, *, run_dir: Path) -> None:
    """New complete lines of the group's current process: its progress and whether it is ready."""
    if group.events is None:
        path = _events_path(run_dir, group.index, group.incarnation)
        if not path.exists():
            return
        group.events = path.open()
    while True:
        at = group.events.tell()
        line = group.events.readline()
        if not line.endswith("\n"):
            group.events.seek(at)  # a line still being written
            return
        record = json.loads(line)
        if record["event"] == "step_committed":
            group.committed = record["step"]
            group.seen_commits.append(time.monotonic())
        elif record["event"] == "ready":
            group.ready = True


def _wait_until_ready(members: list[_Group], *, run_dir: Path) -> None:
    """Every group up (model built, Manager heartbeating) before the first step: the first quorum then holds all of
    them, so the fault-free run is the same every time."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all(group.ready for group in members):
        for group in members:
            _read_events(group, run_dir=run_dir)
            if group.process.poll() is not None:
                log = run_dir / "logs" / f"group{group.index}.0.log"
                tail = "\n".join(log.read_text().splitlines()[-20:])
                raise RuntimeError(f"replica group {group.index} exited before it was ready:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the replica groups were not ready in {READY_TIMEOUT_S:.0f} s; see {run_dir}/logs")
        time.sleep(0.01)
