"""The checkpoint-restart baseline (`ft=checkpoint_restart`): the job as most teams run it today.

torchrun (`torch.distributed.run --max-restarts`) starts the workers; on any failure it stops them all and starts the
whole group again, and every worker reloads the latest disk checkpoint and redoes the steps since. The launcher only
watches: it follows the workers' event files (pids, attempts, committed steps) to show progress and to inject the
configured faults, exactly as the ckptless coordinator does, so both modes face the same failures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ckptless_core.events import EventLog
from ckptless_core.faults import FaultInjector, signal_name
from ckptless_core.job import JobOutcome, describe_exit
from recipes.schema import JobConfig


def torchrun_command(job: JobConfig, *, run_dir: Path) -> list[str]:
    """The torchrun command line: a single-node rendezvous on a free port, restarts, per-attempt worker logs."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={job.cluster.nproc}",
        f"--max-restarts={job.ft.max_restarts}",
        "--monitor-interval=0.1",
        f"--log-dir={run_dir / 'logs' / 'torchrun'}",
        "--redirects=3",
        "-m",
        "recipes.pretrain",
        str(run_dir / "config.yaml"),
    ]


class WorkerWatch:
    """The workers as their event files show them: for each, the latest process (pid, torchrun attempt, rank) and
    the last step it committed. Files are read incrementally, complete lines only."""

    def __init__(self, events_dir: Path) -> None:
        self.events_dir = events_dir
        self.offsets: dict[Path, int] = {}
        self.workers: dict[str, dict] = {}
        self.attempt = 0

    def update(self) -> None:
        for path in sorted(self.events_dir.glob("worker*.jsonl")):
            with path.open("rb") as file:
                file.seek(self.offsets.get(path, 0))
                data = file.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.decode().splitlines():
                self._see(json.loads(line))

    def _see(self, event: dict) -> None:
        name = event["worker"]
        if event["event"] == "worker_start":
            self.attempt = max(self.attempt, event["attempt"])
            self.workers[name] = {
                "pid": event["pid"],
                "attempt": event["attempt"],
                "rank": event["rank"],
                "step": 0,
                "stepped": False,
            }
        elif event["event"] in ("checkpoint_loaded", "train_start", "step_committed") and name in self.workers:
            self.workers[name]["step"] = event["step"]
            self.workers[name]["stepped"] |= event["event"] == "step_committed"

    def live(self) -> dict[str, dict]:
        """Workers of the latest attempt whose process is alive."""
        return {n: w for n, w in self.workers.items() if w["attempt"] == self.attempt and not w.get("exited_at")}

    def newly_exited(self) -> list[tuple[str, dict]]:
        """Workers whose process is gone since the last look (torchrun reaps them; the launcher sees them go)."""
        gone = []
        for name, worker in self.workers.items():
            if not worker.get("exited_at") and not _alive(worker["pid"]):
                worker["exited_at"] = time.time()
                gone.append((name, worker))
        return gone

    def pids(self) -> list[int]:
        """Every worker process seen, of every attempt."""
        return [w["pid"] for w in self.workers.values()]


class TorchrunJob:
    """Runs the job under torchrun; the same `start` / `poll` / `request_stop` / `close` as the ckptless coordinator."""

    def __init__(self, job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> None:
        self.job = job
        self.run_dir = run_dir
        self.threads_per_worker = threads_per_worker
        self.events = EventLog(run_dir / "events" / "launcher.jsonl", worker="launcher")
        self.watch = WorkerWatch(run_dir / "events")
        self.injector = FaultInjector(job.fault.events())
        self.process: subprocess.Popen | None = None
        self.stop_requested = False

    def start(self) -> None:
        command = torchrun_command(self.job, run_dir=self.run_dir)
        env = {
            **os.environ,
            "CKPTLESS_RUN_DIR": str(self.run_dir),
            "OMP_NUM_THREADS": str(self.threads_per_worker),
            "PYTHONUNBUFFERED": "1",
        }
        log = (self.run_dir / "logs" / "torchrun.log").open("ab")
        # A session of its own: a Ctrl-C in the terminal reaches the launcher, which decides what torchrun gets.
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.events.emit("torchrun_started", pid=self.process.pid, command=command)

    def poll(self) -> JobOutcome | None:
        """None while torchrun runs; its outcome once it exited."""
        self.watch.update()
        code = self.process.poll()
        for name, worker in self.watch.newly_exited():
            self.events.emit(
                "worker_exited",
                worker_name=name,
                pid=worker["pid"],
                attempt=worker["attempt"],
                target_rank=worker["rank"],
            )
        if code is None:
            if not self.stop_requested:
                self._inject_faults()
            return None
        self.events.emit("torchrun_exited", exit_code=code)
        self._kill_leftover_workers()
        if code == 0:
            return JobOutcome(ok=True, exit_codes=self.exit_codes(), message="all workers completed")
        message = (
            f"torchrun gave up ({describe_exit(code)}) after {self.watch.attempt} restart(s) of "
            f"{self.job.ft.max_restarts} allowed (ft.max_restarts); worker logs in {self.run_dir}/logs/torchrun/"
        )
        return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=message, reason="failed")

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s` (torchrun's workers are not this process's children: they are polled)."""
        time.sleep(timeout_s)

    def exit_codes(self) -> dict[str, int | None]:
        return {"torchrun": None if self.process is None else self.process.returncode}

    def request_stop(self) -> None:
        """Preemption: torchrun passes SIGTERM on to the workers, which stop where they are (this baseline has no
        step-boundary stop); the next start resumes from the latest checkpoint (`resume=`)."""
        self.stop_requested = True
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.events.emit("stop_requested")

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Stop torchrun (SIGTERM, then SIGKILL after `timeout_s`) and make sure none of its workers outlive it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)
        self._kill_leftover_workers()
        self.events.close()

    def _inject_faults(self) -> None:
        if not self.injector.active:
            return
        live = self.watch.live()
        complete = len(live) == self.job.cluster.nproc
        strikes = self.injector.due(
            now=time.time(),
            members={n: w["rank"] for n, w in live.items()} if complete else {},
            progress={n: w["step"] for n, w in live.items()},
            spares=[],
            recovering=not all(w["stepped"] for w in live.values()),
            sender=None,
        )
        for strike in strikes:
            worker = live[strike.worker]
            _signal(worker["pid"], strike.signum)
            self.events.emit(
                "fault_injected",
                kind=strike.event.kind,
                worker_name=strike.worker,
                target_rank=worker["rank"],
                signal=signal_name(strike.signum),
                step=worker["step"] + 1,
                attempt=worker["attempt"],
            )

    def _kill_leftover_workers(self) -> None:
        """torchrun starts workers in sessions of their own; any it left behind are killed here. A pid is only
        signalled while its command line still names this run's config (pids are reused)."""
        config = str(self.run_dir / "config.yaml").encode()
        for pid in self.watch.pids():
            try:
                command_line = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if config in command_line.split(b"\0"):
                _signal(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
