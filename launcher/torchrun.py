"""The checkpoint-restart baseline (`ft=checkpoint_restart`): the job as most teams run it today.

torchrun (`torch.distributed.run --max-restarts`) starts the workers; on any failure it stops them all and starts the
whole group again, and every worker reloads the latest disk checkpoint and redoes the steps since. The launcher only
watches: it follows the workers' event files (pids, attempts, committed steps) to show progress and to inject the
configured faults, exactly as the ckptless coordinator does, so both modes face the same failures.

`TorchrunJob` runs one torchrun on this machine (`cluster=local`); a cluster kind with hosts places one torchrun
per host (`launcher.clusters.netns.EmulatedTorchrun`), meeting in a c10d rendezvous (`torchrun_command(host=...)`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ckptless_core.events import EventLog
from ckptless_core.faults import FaultInjector, signal_name
from ckptless_core.job import JobOutcome, describe_exit
from ckptless_core.netns import EmulatedHost
from launcher.summary import AttemptNumbers
from recipes.schema import JobConfig

RENDEZVOUS_ID = "ckptless"
KEEP_ALIVE_S = 5
"""A torchrun silent this long leaves the rendezvous (torchrun's default: 15 s). Shorter ones drop live hosts of a
busy machine at start. A lost host is found by whichever comes first: its keep-alive expiring (the replacement then
waits in a new round and the survivors restart) or the survivors' collective timeout."""


def torchrun_command(
    job: JobConfig, *, run_dir: Path, host: tuple[str, str] | None = None, rendezvous: str = ""
) -> list[str]:
    """The torchrun command line. On one host: a single-node rendezvous on a free port. On `host` (name, address)
    of many: the c10d rendezvous at `rendezvous` (`address:port` of the store the launcher holds), the host's own
    address for its workers' store, a host declared dead after KEEP_ALIVE_S without its keep-alive. Restarts,
    per-attempt worker logs."""
    if host is None:
        placement = ["--standalone", f"--nproc-per-node={job.cluster.nproc}"]
        logs = run_dir / "logs" / "torchrun"
    else:
        keep_alive = [
            "keep_alive_interval=1",
            f"keep_alive_max_attempt={KEEP_ALIVE_S}",
            f"join_timeout={math.ceil(job.cluster.start_timeout_s)}",
            "is_host=false",
        ]
        placement = [
            f"--nnodes={job.cluster.num_hosts}",
            f"--nproc-per-node={job.cluster.nproc_per_host}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous}",
            f"--rdzv-id={RENDEZVOUS_ID}",
            f"--rdzv-conf={','.join(keep_alive)}",
            f"--local-addr={host[1]}",
        ]
        logs = run_dir / "logs" / "torchrun" / host[0]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *placement,
        f"--max-restarts={job.ft.max_restarts}",
        "--monitor-interval=0.1",
        f"--log-dir={logs}",
        "--redirects=3",
        "-m",
        "recipes.train",
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
        self.attempts = AttemptNumbers()

    def update(self) -> None:
        for path in sorted(self.events_dir.glob("worker*.jsonl")):
            with path.open("rb") as file:
                file.seek(self.offsets.get(path, 0))
                data = file.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.decode().splitlines():
                self._see(self.attempts.tag(json.loads(line)))

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
    """Runs the job under torchrun; the same `start` / `poll` / `request_stop` / `close` as the ckptless coordinator.
    This class starts one torchrun on this machine; a kind with hosts overrides `start`, `exit_codes`, `close` and
    the two hooks that let `fault=kill_host` find and power off a worker's host (`_host_of`, `_power_off`)."""

    def __init__(self, job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> None:
        self.job = job
        self.run_dir = run_dir
        self.threads_per_worker = threads_per_worker
        self.events = EventLog(run_dir / "events" / "launcher.jsonl", worker="launcher")
        self.watch = WorkerWatch(run_dir / "events")
        per_host = job.cluster.nproc_per_host or job.cluster.nproc
        self.injector = FaultInjector(job.fault.events(), per_host=per_host)
        self.torchruns: dict[str, subprocess.Popen] = {}
        """The torchrun of each host (`local` on one host) that was not powered off."""
        self.stop_requested = False
        self.env = {
            **os.environ,
            "CKPTLESS_RUN_DIR": str(run_dir),
            "OMP_NUM_THREADS": str(threads_per_worker),
            "PYTHONUNBUFFERED": "1",
        }

    def start(self) -> None:
        command = torchrun_command(self.job, run_dir=self.run_dir)
        with (self.run_dir / "logs" / "torchrun.log").open("ab") as log:
            # A session of its own: a Ctrl-C in the terminal reaches the launcher, which decides what it gets.
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self._started("local", process, command)

    def _started(self, name: str, process: subprocess.Popen, command: list[str]) -> None:
        self.torchruns[name] = process
        self.events.emit("torchrun_started", host=name, pid=process.pid, command=command)

    def poll(self) -> JobOutcome | None:
        """None while torchrun runs; the outcome once a torchrun completed, or any one of them gave up."""
        self.watch.update()
        for name, worker in self.watch.newly_exited():
            self.events.emit(
                "worker_exited",
                worker_name=name,
                pid=worker["pid"],
                attempt=worker["attempt"],
                target_rank=worker["rank"],
            )
        codes = {name: process.poll() for name, process in self.torchruns.items()}
        failed = {name: code for name, code in codes.items() if code not in (None, 0)}
        # One torchrun done is the whole job done: each waits at its exit barrier until every host's workers
        # completed. Any still running (leaving its barrier) is stopped by `close`.
        if not failed and 0 not in codes.values():
            if not self.stop_requested:
                self._inject_faults()
            return None
        for name, code in codes.items():
            if code is not None:
                self.events.emit("torchrun_exited", host=name, exit_code=code)
        if not failed:
            return JobOutcome(ok=True, exit_codes=self.exit_codes(), message="all workers completed")
        name, code = next(iter(failed.items()))
        message = (
            f"torchrun{'' if name == 'local' else ' on ' + name} gave up ({describe_exit(code)}) after "
            f"{self.watch.attempt} restart(s) of {self.job.ft.max_restarts} allowed (ft.max_restarts); worker logs "
            f"in {self.run_dir}/logs/torchrun/"
        )
        return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=message, reason="failed")

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s` (torchrun's workers are not this process's children: they are polled)."""
        time.sleep(timeout_s)

    def exit_codes(self) -> dict[str, int | None]:
        return {"torchrun": self.torchruns["local"].returncode if self.torchruns else None}

    def request_stop(self) -> None:
        """Preemption: torchrun passes SIGTERM on to the workers, which stop where they are (this baseline has no
        step-boundary stop); the next start resumes from the latest checkpoint (`resume=`)."""
        self.stop_requested = True
        for process in self.torchruns.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        self.events.emit("stop_requested")

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Stop every torchrun (SIGTERM, then SIGKILL after `timeout_s`) and make sure none of their workers
        outlive them."""
        try:
            for process in self.torchruns.values():
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in self.torchruns.values():
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=timeout_s)
            self._kill_leftover_workers()
        finally:
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
            host = self._host_of(worker["pid"])
            if strike.event.kind == "kill_host":
                if host is None:
                    continue  # the worker is gone already (its host with it): nothing left to power off
                self._power_off(host)
            else:
                _signal(worker["pid"], strike.signum)
            self.events.emit(
                "fault_injected",
                kind=strike.event.kind,
                worker_name=strike.worker,
                target_rank=worker["rank"],
                signal=signal_name(strike.signum),
                host=host.name if host is not None else "local",
                step=worker["step"] + 1,
                attempt=worker["attempt"],
            )

    def _host_of(self, pid: int) -> EmulatedHost | None:
        """The host whose power `fault=kill_host` can cut, that worker `pid` runs on: none on this machine alone
        (compose refuses host faults here)."""
        return None

    def _power_off(self, host: EmulatedHost) -> None:
        raise AssertionError("no host to power off on one machine: `_host_of` found none")

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
