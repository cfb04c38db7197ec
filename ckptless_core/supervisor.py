"""The supervisor: hosts the coordination store, starts worker processes, watches them, collects exit codes.

Workers are forked from a fork server that imported the heavy modules (torch, transformers, the entry point)
once, so each worker starts in a fraction of a second instead of paying the imports again.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ckptless_core.events import EventLog
from ckptless_core.worker_process import run_worker


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


@dataclass
class JobOutcome:
    ok: bool
    """True when every worker exited with code 0."""
    exit_codes: dict[str, int]
    """Exit code per worker (negative: killed by that signal)."""
    message: str
    """What happened, for the console."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class Supervisor:
    """Runs one job of `spec.nproc` workers on this machine; `poll()` until it returns an outcome."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.events = EventLog(spec.run_dir / "events" / "supervisor.jsonl", worker="supervisor")
        self.store: dist.TCPStore | None = None
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}

    @property
    def master_addr(self) -> str:
        return "127.0.0.1"

    def start(self) -> None:
        # The store lives as long as the supervisor, so workers (and later, replacements) can always reach it.
        self.store = dist.TCPStore(
            self.master_addr,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.spec.store_timeout_s),
        )
        context = start_fork_server(self.spec.preload)
        for rank in range(self.spec.nproc):
            self._start_worker(context, rank=rank)

    def worker_env(self, rank: int) -> dict[str, str]:
        """The environment of worker `rank`: torchrun-compatible names plus the run directory."""
        assert self.store is not None
        return {
            **self.spec.env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.spec.nproc),
            "LOCAL_WORLD_SIZE": str(self.spec.nproc),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.store.port),
            "CKPTLESS_WORKER": f"worker{rank}",
            "CKPTLESS_RUN_DIR": str(self.spec.run_dir),
            "OMP_NUM_THREADS": str(self.spec.threads_per_worker),
        }

    def _start_worker(self, context, *, rank: int) -> None:
        name = f"worker{rank}"
        log_path = self.spec.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        process = context.Process(
            target=run_worker,
            kwargs={
                "entry": self.spec.entry,
                "env": self.worker_env(rank),
                "log_path": str(log_path),
                "threads": self.spec.threads_per_worker,
                "supervisor_pid": os.getpid(),
            },
            name=name,
            daemon=False,
        )
        process.start()
        self.processes[name] = process
        self.events.emit("worker_started", worker_name=name, pid=process.pid, worker_rank=rank)

    def poll(self) -> JobOutcome | None:
        """None while the job runs; the outcome once every worker exited or one failed (the rest are stopped)."""
        codes = {name: p.exitcode for name, p in self.processes.items()}
        failed = {name: code for name, code in codes.items() if code not in (None, 0)}
        if failed:
            name, code = next(iter(failed.items()))
            self.events.emit("worker_failed", worker_name=name, exit_code=code, detected_by="process_exit")
            self.stop()
            codes = {n: p.exitcode for n, p in self.processes.items()}
            return JobOutcome(ok=False, exit_codes=codes, message=f"{name} failed ({describe_exit(code)})")
        if all(code == 0 for code in codes.values()):
            self.events.emit("job_completed")
            return JobOutcome(ok=True, exit_codes=codes, message="all workers completed")
        return None

    def wait(self, *, poll_interval_s: float = 0.1) -> JobOutcome:
        while (outcome := self.poll()) is None:
            time.sleep(poll_interval_s)
        return outcome

    def stop(self, *, grace_s: float = 5.0) -> None:
        """Terminate every live worker: SIGTERM, then SIGKILL after `grace_s`. Bounded."""
        live = [p for p in self.processes.values() if p.exitcode is None]
        for process in live:
            _signal(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in live:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in live:
            if process.exitcode is None:
                _signal(process, signal.SIGKILL)
                process.join(timeout=5.0)

    def close(self) -> None:
        self.stop()
        self.events.close()
        self.store = None


def start_fork_server(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    """Start the fork server now, importing `preload` in the background, so later worker starts are fast.

    Calling it early (before other start-up work) overlaps those imports with that work. Idempotent.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    multiprocessing.forkserver.ensure_running()
    return context


def _signal(process, signum: int) -> None:
    try:
        os.kill(process.pid, signum)
    except (ProcessLookupError, TypeError):
        pass
