"""The coordinator as a process of its own, so that it can die and be restarted in place.

`CoordinatorProcess` (the launcher's side) holds the listening sockets of the control channels and of the store and
hands them to every coordinator process it starts: a restarted one serves the same address and port, and agents
that reconnect meanwhile wait in the listen queue. Coordinators are forked from a fork server that imported the
coordinator's code (torch among it) once, when the launcher started: a restart costs a fork, not an interpreter's
imports, so the job is without a coordinator for a fraction of a second and the hosts' CPUs are not taken from
training meanwhile. A coordinator process gets only the run directory and the secret: the first starts the job
from `<run dir>/coordinator/spec.json`, a later one resumes it from the journal. Its outcome goes to
`<run dir>/coordinator/outcome.json`, its output to `logs/coordinator.log`.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import socket
import sys
from dataclasses import asdict
from pathlib import Path

from ckptless_core.channel import SECRET_FILE, write_secret_file
from ckptless_core.coordinator_address import write_coordinator_address
from ckptless_core.events import EventLog
from ckptless_core.faults import FaultEvent
from ckptless_core.job import JobOutcome, JobSpec, describe_exit
from ckptless_core.journal import journal_path, read_journal
from ckptless_core.worker_process import exit_with

STOP = b"s"
"""Command: stop cleanly at a step boundary (preemption)."""
SHUTDOWN = b"x"
"""Command: end the job now (every agent kills what is left)."""
STRIKE_HOST = "strike_host "
"""Request from the coordinator to its launcher, followed by a fault event's JSON: strike a host (`kill_host`,
`partition`)."""


def _paths(run_dir: Path) -> tuple[Path, Path]:
    folder = run_dir / "coordinator"
    return folder / "spec.json", folder / "outcome.json"


def start_coordinator_server() -> multiprocessing.context.BaseContext:
    """The fork server coordinators are forked from, importing the coordinator's code now (in the background)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["ckptless_core.fork_server", "ckptless_core.coordinator", "ckptless_core.fault_driver"]
    )
    multiprocessing.forkserver.ensure_running()
    return context


def run_coordinator(
    run_dir: Path,
    secret: bytes,
    launcher_pid: int,
    control: socket.socket,
    store_listener: socket.socket,
    commands: multiprocessing.connection.Connection,
    requests: multiprocessing.connection.Connection,
    advertise: str | None = None,
) -> None:
    """A coordinator process: start the job, or resume it from the journal, and serve it until it ends. `advertise`:
    the name agents reach it by, said in `coordinator/address` (default: the address it binds)."""
    exit_with(launcher_pid)  # nothing would restart it, nor read its outcome
    log = os.open(run_dir / "logs" / "coordinator.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(log, stream)
    os.close(log)

    from ckptless_core.coordinator import Coordinator  # (imported already by the fork server)
    from ckptless_core.fault_driver import FaultDriver

    spec_path, outcome_path = _paths(run_dir)
    spec = JobSpec.load(spec_path)

    def strike_host(event: FaultEvent, host: str) -> None:
        requests.send_bytes(f"{STRIKE_HOST}{json.dumps({'event': asdict(event), 'host': host})}".encode())

    # Agents and workers reach it (the channel, the store) by the advertised name where there is one.
    coordinator = Coordinator(
        secret=secret, bind_address=advertise or control.getsockname()[0], listener=control, store_socket=store_listener
    )
    write_coordinator_address(run_dir, coordinator.address)
    try:
        if journal_path(run_dir).exists():
            coordinator.resume(spec)
        else:
            coordinator.start(spec)
        # Test apparatus only where a fault is configured: the coordinator's own code has no branch for it.
        faults = FaultDriver(coordinator, spec.faults, strike_host=strike_host) if spec.faults else None
        outcome = _serve(coordinator, commands, faults)
    except TimeoutError as error:  # agents that did not join in time
        outcome = JobOutcome(ok=False, exit_codes=coordinator.exit_codes(), message=str(error), reason="failed")
    finally:
        coordinator.close()
    outcome.save(outcome_path)
    sys.stdout.flush()
    sys.stderr.flush()


def _serve(coordinator, commands: multiprocessing.connection.Connection, faults) -> JobOutcome:
    stopping = False
    while (outcome := coordinator.poll()) is None:
        if faults is not None:
            faults.strike_due()
        received = b""
        try:
            while commands.poll():
                received += commands.recv_bytes()
        except EOFError:  # the launcher is gone: no `close`, which would shut down agents that can outlive it
            os.kill(os.getpid(), signal.SIGKILL)
        if SHUTDOWN in received:
            return JobOutcome(ok=False, exit_codes=coordinator.exit_codes(), message="stopped", reason="stopped")
        if STOP in received and not stopping:
            stopping = True
            coordinator.request_stop()
        coordinator.wait_for_change(0.05)
    return outcome


class CoordinatorProcess:
    """The launcher's side: starts the coordinator process, restarts it in place when it dies without an outcome,
    and carries out its requests; the same `start` / `poll` / `wait_for_change` / `request_stop` / `close` /
    `exit_codes` as an in-process `Coordinator`."""

    def __init__(
        self, *, secret: bytes, bind_address: str = "127.0.0.1", port: int = 0, advertise: str | None = None
    ) -> None:
        """`advertise`: the name agents reach the coordinator by (`coordinator/address`), when not `bind_address`."""
        self.secret = secret
        self.advertise = advertise
        self.control = socket.create_server((bind_address, port), backlog=128)
        self.store_listener = socket.create_server((bind_address, 0), backlog=1024)
        self.address = (bind_address, self.control.getsockname()[1])
        self.context = start_coordinator_server()
        self._commands_r, self._commands = multiprocessing.Pipe(duplex=False)
        self._requests, self._requests_w = multiprocessing.Pipe(duplex=False)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.outcome: JobOutcome | None = None
        self.spec: JobSpec | None = None
        self.events: EventLog | None = None
        self.stop_requested = False
        self.restarts_without_progress = 0
        self._progress_mark = -1

    def start(self, spec: JobSpec) -> None:
        self.spec = spec
        spec_path, _ = _paths(spec.run_dir)
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec.save(spec_path)
        if not (spec.run_dir / SECRET_FILE).exists():  # (a kind whose agents read it wrote it already)
            write_secret_file(spec.run_dir / SECRET_FILE, self.secret)
        self.events = EventLog(spec.run_dir / "events" / "launcher.jsonl", worker="launcher")
        self._spawn()

    def _spawn(self) -> None:
        (self.spec.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.process = self.context.Process(
            target=run_coordinator,
            args=(self.spec.run_dir, self.secret, os.getpid(), self.control, self.store_listener),
            kwargs={"commands": self._commands_r, "requests": self._requests_w, "advertise": self.advertise},
            name="ckptless-coordinator",
        )
        self.process.start()  # (it ignores SIGINT and SIGTERM: the launcher decides how the job stops)
        if self.stop_requested:
            self._commands.send_bytes(STOP)

    def poll(self) -> JobOutcome | None:
        self._serve_requests()
        if self.outcome is not None or self.process is None:
            return self.outcome
        code = self.process.exitcode
        if code is None:
            return None
        _, outcome_path = _paths(self.spec.run_dir)
        if outcome_path.exists():
            self.outcome = JobOutcome.load(outcome_path)
            return self.outcome
        return self._restart(code)

    def _restart(self, code: int) -> JobOutcome | None:
        """The coordinator died without an outcome: start a fresh one, which resumes from the journal. Bounded:
        `ft.max_failures_without_progress` restarts in a row without a step committed in between end the job."""
        detail = f"the coordinator (pid {self.process.pid}) died: {describe_exit(code)}"
        self.events.emit("coordinator_lost", pid=self.process.pid, exit_code=code, detail=detail)
        if not any(r["op"] == "generation" for r in read_journal(journal_path(self.spec.run_dir))):
            message = f"{detail} before the job started; see {self.spec.run_dir}/logs/coordinator.log"
            self.outcome = JobOutcome(ok=False, exit_codes={}, message=message, reason="failed")
            return self.outcome
        metrics = self.spec.run_dir / "metrics.jsonl"
        mark = metrics.stat().st_size if metrics.exists() else 0
        self.restarts_without_progress = 1 if mark > self._progress_mark else self.restarts_without_progress + 1
        self._progress_mark = mark
        if self.restarts_without_progress > self.spec.ft.max_failures_without_progress:
            message = (
                f"{detail}, {self.restarts_without_progress} times in a row without a committed step "
                f"(ft.max_failures_without_progress={self.spec.ft.max_failures_without_progress}); giving up; see "
                f"{self.spec.run_dir}/logs/coordinator.log"
            )
            self.outcome = JobOutcome(ok=False, exit_codes={}, message=message, reason="no_progress")
            return self.outcome
        self._spawn()
        self.events.emit("coordinator_restarted", pid=self.process.pid, port=self.address[1])
        return None

    def _serve_requests(self) -> None:
        while self._requests.poll():
            line = self._requests.recv_bytes().decode()
            if line.startswith(STRIKE_HOST):
                request = json.loads(line.removeprefix(STRIKE_HOST))
                self.strike_host(FaultEvent(**request["event"]), request["host"])

    def strike_host(self, event: FaultEvent, host: str) -> None:
        """`fault=kill_host` or `partition`: only a cluster that owns its hosts can (`cluster=netns`)."""
        raise NotImplementedError(f"this cluster cannot strike host {host} ({event.kind})")

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, waking when the coordinator exits or asks for something."""
        watched = [self._requests] + ([self.process.sentinel] if self.process is not None else [])
        multiprocessing.connection.wait(watched, timeout=max(0.0, timeout_s))

    def request_stop(self) -> None:
        """Preemption: every worker stops cleanly at the same step boundary (see `Coordinator.request_stop`)."""
        self.stop_requested = True
        self._commands.send_bytes(STOP)

    def exit_codes(self) -> dict[str, int | None]:
        return dict(self.outcome.exit_codes) if self.outcome is not None else {}

    def wait(self) -> JobOutcome:
        while (outcome := self.poll()) is None:
            self.wait_for_change(1.0)
        return outcome

    def close(self) -> None:
        """End the job now if it still runs (every agent kills what is left and exits). Idempotent."""
        if self.control.fileno() < 0:
            return
        if self.process is not None and self.process.exitcode is None:
            self._commands.send_bytes(SHUTDOWN)
            self.process.join(timeout=15.0)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()
        if self.outcome is None and self.spec is not None:
            _, outcome_path = _paths(self.spec.run_dir)
            if outcome_path.exists():
                self.outcome = JobOutcome.load(outcome_path)
        for end in (self._commands_r, self._commands, self._requests, self._requests_w):
            end.close()
        self.control.close()
        self.store_listener.close()
        if self.events is not None:
            self.events.close()
