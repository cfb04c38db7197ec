"""The coordinator: one per job. It admits the node agents, decides which worker holds which rank, detects failures
from what the agents relay (exits at once, silence on its own clock, reports, stalled steps), fences the culprit
through its agent, promotes a spare or shrinks the job, and publishes the next generation. It also hosts the c10d
store, which serves only the collective backend's rendezvous.

It never touches a worker directly: every start, signal and fence goes through the worker's agent. `cluster=local`
is this with one agent on this machine (`LocalCluster`).

It may die: every decision goes to its journal (`journal.py`) before anyone hears of it, and a coordinator started
afresh on the same address and port (`resume`) rebuilds its view from the journal and from what the agents, which
keep their workers and reconnect, resend. Steps whose collectives succeed need no coordinator meanwhile.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ckptless_core.agent import HostJob
from ckptless_core.control_server import ControlServer, Refusal
from ckptless_core.events import EventLog
from ckptless_core.faults import HOST_KINDS, FaultEvent, FaultInjector, signal_name
from ckptless_core.job import WORKER_EXIT_TRAINING_CODE_ERROR, JobOutcome, JobSpec, describe_exit
from ckptless_core.journal import Journal, journal_path, read_journal
from ckptless_core.layout import Layout
from ckptless_core.protocol import (
    PROTOCOL_VERSION,
    ChannelClosed,
    CoordinatorHeartbeat,
    FailureReport,
    FenceWorker,
    Generation,
    Heartbeat,
    Hello,
    HostHeartbeat,
    Position,
    Progress,
    Ready,
    Refused,
    Resent,
    Shutdown,
    SignalWorker,
    SourceAnnounced,
    StartWorker,
    StopAt,
    Welcome,
    WorkerExited,
    WorkerStarted,
    blame_stalled,
    new_store_prefix,
)
from ckptless_core.replacement import replace_lost


@dataclass
class _Worker:
    name: str
    host: str
    spare: bool
    started_at: float
    """Coordinator's monotonic clock, like every time below."""
    pid: int = 0
    exit_code: int | None = None
    retired: bool = False
    """No longer part of the job: a lost member, a lost spare, or a fenced worker."""
    last_heard: float = 0.0
    ready: bool = False
    committed: tuple[int, int] | None = None
    """(generation, steps committed) of the latest `committed` marker."""
    position: Position | None = None
    position_generation: int = 0
    active_since: float = 0.0
    """When its first progress marker of `position_generation` arrived."""
    lost_with_host: str = ""
    """Why this worker is gone with its host (empty: it is not)."""
    failure: tuple[FailureReport, float] | None = None
    source_of: int = 0
    """The generation this worker announced itself as the state source of."""

    @property
    def alive(self) -> bool:
        return self.exit_code is None and not self.retired


@dataclass
class _Host:
    name: str
    channel: object
    last_heard: float
    workers: list[str] = field(default_factory=list)
    capacity: int = 0
    """Processes the host runs at most: what it was given at the start, or `nproc_per_host` for a host that joins
    a running job (a replaced node); replacement spares go where a slot is free."""
    resent: bool = True
    """False while an agent that reconnected to a restarted coordinator resends its reports."""


class Coordinator:
    """Runs one job over its agents; `start()`, then `poll()` until it returns an outcome."""

    def __init__(
        self,
        *,
        secret: bytes,
        bind_address: str = "127.0.0.1",
        port: int = 0,
        listener: socket.socket | None = None,
        store_socket: socket.socket | None = None,
        strike_host: Callable[[FaultEvent, str], None] | None = None,
    ) -> None:
        """`listener`, `store_socket`: listening sockets to serve the control channels and the store on (a restarted
        coordinator takes over its predecessor's); `strike_host(event, host)`: how this cluster powers a host off or
        cuts it off (`kill_host`, `partition`), where it can."""
        self.secret = secret
        self.bind_address = bind_address
        self.control = ControlServer(secret=secret, bind_address=bind_address, port=port, listener=listener)
        self.address = self.control.address
        self._store_socket = store_socket
        self.strike_host = strike_host
        self.journal: Journal | None = None
        self.lost_hosts: set[str] = set()
        """Hosts declared lost: an agent of one that comes back is refused (its workers were replaced)."""
        self.ending = False
        """Every agent was told to shut down: a host that leaves now is done, not lost."""
        self._closed = threading.Event()
        self._journaled_hosts: dict[str, int] = {}
        """Resuming: host -> capacity, as the journal has them."""
        self.hosts: dict[str, _Host] = {}
        self.workers: dict[str, _Worker] = {}
        self.generation = Generation()
        self.spec: JobSpec | None = None
        self.events: EventLog | None = None
        self.next_worker_id = 0
        self._spares_owed = 0
        self.failures_without_progress = 0
        self.progress_at_last_failure = -1
        self.injected_at: dict[str, float] = {}
        self.last_commit: tuple[int, float] = (0, time.monotonic())
        """(highest step committed by any member, when it arrived)."""
        self.store: dist.TCPStore | None = None

    # --- start ------------------------------------------------------------------------------------------------

    @property
    def spares_owed(self) -> int:
        """Spares promoted or lost and not replaced yet."""
        return self._spares_owed

    @spares_owed.setter
    def spares_owed(self, value: int) -> None:
        self._spares_owed = value
        self.journal.write("spares_owed", value=value)

    def _open(self, spec: JobSpec) -> None:
        self.spec = spec
        self.ft = spec.ft
        self.per_host = -(-spec.nproc // spec.num_hosts)
        self.injector = FaultInjector(spec.faults, per_host=self.per_host)
        self.events = EventLog(spec.run_dir / "events" / "coordinator.jsonl", worker="coordinator")
        self.journal = Journal(journal_path(spec.run_dir))
        self.store, self._store_socket = _bound_store(
            self.bind_address, timeout_s=spec.store_timeout_s, sock=self._store_socket
        )
        self.heartbeat_interval_s = min(0.25, spec.ft.host_timeout_s / 8)
        threading.Thread(target=self._beat, name="coordinator-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        """Every agent hears from the coordinator at least every heartbeat interval, from a thread of its own (the
        main loop may wait on a fence): the lease of its host holds (see `agent`)."""
        while not self._closed.wait(self.heartbeat_interval_s):
            for host in list(self.hosts.values()):
                try:
                    host.channel.send(CoordinatorHeartbeat(generation=self.generation.number))
                except (ChannelClosed, OSError):
                    pass  # the main loop learns of it from the channel's reader

    def start(self, spec: JobSpec) -> None:
        """Host the store, admit `spec.num_hosts` agents (bounded by the start timeout), start every worker."""
        self._open(spec)
        self.events.emit(
            "coordinator_started",
            address=self.address[0],
            port=self.address[1],
            store_port=self.store.port,
            pid=os.getpid(),
        )
        deadline = time.monotonic() + spec.store_timeout_s
        expected = spec.num_hosts + spec.spare_hosts
        while len(self.hosts) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(self.hosts)} of {expected} node agents joined within {spec.store_timeout_s:.0f} s"
                )
            self.wait_for_change(0.1)
            self._drain()
        names = sorted(self.hosts)
        self.training_hosts, spare_hosts = names[: spec.num_hosts], names[spec.num_hosts :]
        self.journal.write("hosts", names=names)
        members = {}
        for rank in range(spec.nproc):
            members[self._start_worker(self.training_hosts[rank // self.per_host], spare=False)] = rank
        self._publish(Generation(number=1, members=members, reason="start", store_prefix=new_store_prefix(1)))
        if self.ft.enabled:
            for i in range(self.ft.spares):
                self._start_worker(self.training_hosts[i % len(self.training_hosts)], spare=True)
            for host in spare_hosts:
                for _ in range(self.per_host):
                    self._start_worker(host, spare=True)
        for host in self.hosts.values():
            self._set_capacity(host.name, len(host.workers))

    def resume(self, spec: JobSpec) -> None:
        """Take over a running job after the coordinator before this one died: replay the journal, wait (bounded)
        for every host's agent to reconnect and resend what it knows; a host that does not is lost. A generation
        that was still forming is published again under a new number: its rendezvous keys died with the old
        store."""
        self._open(spec)
        records = read_journal(journal_path(spec.run_dir))
        for record in records:
            self._replay(record)
        self.events.emit(
            "coordinator_resumed",
            generation=self.generation.number,
            journal_records=len(records),
            port=self.address[1],
            pid=os.getpid(),
        )
        expected = set(self._journaled_hosts) - self.lost_hosts
        deadline = time.monotonic() + max(5.0, 3 * self.ft.host_timeout_s)
        while not all(h in self.hosts and self.hosts[h].resent for h in expected):
            if time.monotonic() > deadline:
                break
            self.wait_for_change(0.1)
            self._drain()
        for host in sorted(expected):
            if host not in self.hosts or not self.hosts[host].resent:
                self._host_lost(host, "its agent did not reconnect to the restarted coordinator")
        members = self.generation.members
        if self._recovering() and all(self.workers[n].alive for n in members):
            self._publish_next(dict(members), reason="coordinator_restart")

    def _replay(self, record: dict) -> None:
        op = record["op"]
        if op == "hosts":
            self._journaled_hosts = dict.fromkeys(record["names"], 0)
            self.training_hosts = record["names"][: self.spec.num_hosts]
        elif op == "host":
            self._journaled_hosts[record["name"]] = record["capacity"]
        elif op == "worker":
            name = record["name"]
            self.workers[name] = _Worker(
                name=name, host=record["host"], spare=record["spare"], started_at=time.monotonic()
            )
            self.next_worker_id = max(self.next_worker_id, int(name.removeprefix("worker")) + 1)
        elif op == "generation":
            self.generation = Generation(**{key: value for key, value in record.items() if key != "op"})
        elif op == "retired":
            self.workers[record["name"]].retired = True
        elif op == "host_lost":
            self.lost_hosts.add(record["name"])
        elif op == "spares_owed":
            self._spares_owed = record["value"]
        elif op == "fault_fired":
            self.injector.fired(FaultEvent(**record["event"]))
            self.injected_at[record["worker"]] = record["t"]  # a failure it caused is timed from then

    def _set_capacity(self, host: str, capacity: int) -> None:
        self.hosts[host].capacity = capacity
        self.journal.write("host", name=host, capacity=capacity)

    def _start_worker(self, host: str, *, spare: bool, background: bool = False) -> str:
        name = f"worker{self.next_worker_id}"
        self.next_worker_id += 1
        self.journal.write("worker", name=name, host=host, spare=spare)
        self.workers[name] = _Worker(name=name, host=host, spare=spare, started_at=time.monotonic())
        self.hosts[host].workers.append(name)
        self._to_host(host, StartWorker(worker=name, spare=spare, background=background))
        return name

    def _retire(self, name: str) -> None:
        self.workers[name].retired = True
        self.journal.write("retired", name=name)

    def _publish(self, generation: Generation) -> None:
        self.journal.write("generation", **asdict(generation))
        self.generation = generation
        # Counted before anyone hears of it: once sent, its members' rendezvous keys arrive at their own pace.
        self._forget_old_generations()
        store_keys = self.store.num_keys()
        for host in self.hosts:
            self._to_host(host, generation)
        self.events.emit(
            "generation_started",
            generation=generation.number,
            members=generation.members,
            world_size=generation.world_size,
            reason=generation.reason,
            store_keys=store_keys,
        )

    def _forget_old_generations(self) -> None:
        """Delete the rendezvous keys of generations before the previous one, so the store stays flat however many
        recoveries a job goes through (the previous generation's may still be read by a worker leaving it)."""
        keep_from = self.generation.number - 1
        for key in self.store.list_keys():
            number = key.split("/gen", 1)[-1].split("/", 1)[0]
            if number.isdigit() and int(number) < keep_from:
                self.store.delete_key(key)

    # --- messages ------------------------------------------------------------------------------------------------

    def _drain(self) -> None:
        for host, message, received_at in self.control.messages():
            if isinstance(message, Refusal):
                self.events.emit("control_refused", peer=message.peer, reason=message.reason)
            elif isinstance(message, Hello):
                self._admit(message, host)
            elif message is None:
                self._host_lost(host, "its agent's channel closed")
            elif host in self.hosts:
                self.hosts[host].last_heard = received_at
                if not isinstance(message, HostHeartbeat):
                    self._record(host, message, received_at)

    def _admit(self, hello: Hello, channel) -> None:
        reason = ""
        if hello.version != str(PROTOCOL_VERSION):
            reason = (
                f"agent speaks protocol {hello.version}, the coordinator {PROTOCOL_VERSION}: install the same ckptless"
            )
        elif hello.config_sha256 and hello.config_sha256 != self.spec.config_sha256:
            reason = "the agent's run directory holds another config.yaml than this job's: start it with this job's --run-dir"
        elif hello.name in self.hosts:
            reason = f"a host named {hello.name!r} already joined: give each agent its own --host"
        elif hello.name in self.lost_hosts:
            reason = (
                f"host {hello.name!r} was declared lost and its ranks replaced: its workers' state is stale; restart "
                "its agent (under a new --host name) to join as a spare"
            )
        if reason:
            self.events.emit("agent_refused", host=hello.name, reason=reason)
            try:
                channel.send(Refused(reason=reason))
            except ChannelClosed:
                pass
            channel.close()
            return
        job = HostJob(
            entry=self.spec.entry,
            run_dir=str(self.spec.run_dir),
            env={**self._worker_env()},
            threads_per_worker=self.spec.threads_per_worker,
            preload=list(self.spec.preload),
            heartbeat_interval_s=self.heartbeat_interval_s,
            coordinator_timeout_s=self.ft.coordinator_timeout_s,
            lease_s=self.ft.lease_s,
        )
        rejoining = hello.name in self._journaled_hosts
        if not rejoining:
            self.journal.write("host", name=hello.name, capacity=self.per_host if self.generation.number else 0)
        try:
            channel.send(Welcome(job=asdict(job)))
        except ChannelClosed:
            return
        host = self.hosts[hello.name] = _Host(name=hello.name, channel=channel, last_heard=time.monotonic())
        self.events.emit("agent_joined", host=hello.name, pid=hello.pid, rejoined=rejoining)
        self.control.serve(hello.name, channel)
        if rejoining:
            # Its workers, as the journal has them; what became of each arrives with the agent's resent reports.
            host.capacity = self._journaled_hosts[hello.name]
            host.workers = [n for n, w in self.workers.items() if w.host == hello.name]
            host.resent = False
            self._to_host(hello.name, self.generation)
        elif self.generation.number:
            host.capacity = self.per_host  # a replaced node: its slots take the spares owed

    def _worker_env(self) -> dict[str, str]:
        """torchrun-compatible names (a worker's rank comes from the generation it joins) plus the store's address."""
        return {
            **self.spec.env,
            "RANK": "-1",
            "WORLD_SIZE": str(self.spec.nproc),
            "LOCAL_WORLD_SIZE": str(self.spec.nproc),
            "MASTER_ADDR": self.bind_address,
            "MASTER_PORT": str(self.store.port),
            "CKPTLESS_SUPERVISED": "1",
            "CKPTLESS_RUN_DIR": str(self.spec.run_dir),
            "OMP_NUM_THREADS": str(self.spec.threads_per_worker),
        }

    def _record(self, host: str, message, received_at: float) -> None:
        if isinstance(message, Resent):
            self._resent(host, message)
            return
        worker = self.workers.get(getattr(message, "worker", ""))
        if worker is None or worker.host != host or (worker.retired and not isinstance(message, WorkerExited)):
            # Not this host's worker, or one no longer in the job (fenced, lost): whatever it says changes nothing.
            if not isinstance(message, Heartbeat):
                self.events.emit(
                    "report_refused",
                    host=host,
                    message=type(message).__name__,
                    worker_name=getattr(message, "worker", ""),
                )
            return
        worker.last_heard = received_at
        if isinstance(message, WorkerStarted):
            worker.pid = message.pid
            worker.started_at = received_at  # silence counts from the fork, not from the order (imports may delay it)
            if self.hosts[host].resent:  # (a resent one was recorded by the coordinator that died)
                self.events.emit(
                    "worker_started", worker_name=worker.name, pid=message.pid, spare=message.spare, host=host
                )
        elif isinstance(message, WorkerExited):
            worker.exit_code = message.exit_code
        elif isinstance(message, Ready):
            worker.ready = True
        elif isinstance(message, Progress):
            previous = worker.position
            renewal = (
                previous is not None
                and message.marker == "collective_waiting"
                and previous.step == message.step
                and previous.marker in ("collective_entered", "collective_waiting")
            )
            since = previous.since if renewal else received_at
            worker.position = Position(step=message.step, marker=message.marker, received_at=received_at, since=since)
            if message.generation != worker.position_generation:
                worker.active_since = received_at
            worker.position_generation = message.generation
            if message.marker == "committed":
                worker.committed = (message.generation, message.step)
                if message.step > self.last_commit[0]:
                    self.last_commit = (message.step, received_at)
        elif isinstance(message, FailureReport):
            worker.failure = (message, received_at)
        elif isinstance(message, SourceAnnounced):
            worker.source_of = message.generation

    def _resent(self, host: str, message: Resent) -> None:
        """A reconnected agent resent all it holds: a worker the journal places on its host that it never started
        (the coordinator died between journaling the order and sending it) is gone."""
        self.hosts[host].resent = True
        for name in self.hosts[host].workers:
            worker = self.workers[name]
            if name not in message.workers and worker.exit_code is None:
                worker.exit_code = -signal.SIGKILL
                worker.lost_with_host = f"never started on host {host}: the coordinator died before ordering it"
        self.events.emit("agent_resent", host=host, workers=message.workers)

    def _host_lost(self, host: str, detail: str) -> None:
        """The host's agent is gone (its channel closed, or it fell silent): every process of the host with it."""
        if host in self.lost_hosts:
            return
        if self.ending:
            if (left := self.hosts.pop(host, None)) is not None:
                left.channel.close()
                self.events.emit("host_left", host=host)
            return
        self.events.emit("host_lost", host=host, detail=detail)
        self.journal.write("host_lost", name=host)
        self.lost_hosts.add(host)
        lost = self.hosts.pop(host, None)
        if lost is not None:
            lost.channel.close()
        for worker in self.workers.values():
            if worker.host == host and worker.exit_code is None:
                worker.exit_code = -signal.SIGKILL
                worker.lost_with_host = f"host {host} lost: {detail}"

    # --- watch ------------------------------------------------------------------------------------------------

    def poll(self) -> JobOutcome | None:
        """None while the job runs; the outcome once every member finished, or the job cannot go on."""
        self._drain()
        members = self.generation.members
        codes = {name: self.workers[name].exit_code for name in members}
        if codes and all(code == 0 for code in codes.values()):
            self.events.emit("job_completed", generation=self.generation.number)
            self.stop()
            return JobOutcome(ok=True, exit_codes=self.exit_codes(), message="all workers completed")
        if (outcome := self._training_code_error(codes)) is not None:
            return outcome
        if (outcome := self._past_progress_deadline()) is not None:
            return outcome
        failures = self._detect_failures(codes)
        if failures and 0 in codes.values():
            # A member completed every step, so every collective of the run completed: what failed since is the
            # end of a worker, not of the training.
            self.events.emit("job_completed", generation=self.generation.number)
            self.stop()
            message = f"all steps completed; then {', '.join(sorted(failures))} failed"
            return JobOutcome(ok=True, exit_codes=self.exit_codes(), message=message)
        if failures:
            if not self.ft.enabled:
                self._settle()  # let failures that happen together all surface before reporting
                failures = self._detect_failures({n: self.workers[n].exit_code for n in members})
                self.stop()
                # A worker killed by a signal is the likely cause; peers that then exited with an error follow.
                ordered = sorted(failures.items(), key=lambda kv: not kv[1]["detail"].startswith("killed"))
                message = "; ".join(f"{name} failed ({failure['detail']})" for name, failure in ordered)
                return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=message, reason="failed")
            outcome = self._recover_from(failures)
            if outcome is not None:
                return outcome
        if self.ft.enabled:
            self._replace_lost_spares()
            self._maybe_grow()
            self._start_owed_spares()
        self._inject_faults()
        return None

    def _training_code_error(self, codes: dict[str, int | None]) -> JobOutcome | None:
        """A member whose training code raised the same error again after a replay ends the job at once: a bug is
        not a failure, and no spare is spent on it. The traceback comes with its report."""
        culprits = [n for n, code in codes.items() if code == WORKER_EXIT_TRAINING_CODE_ERROR]
        culprits += [
            n for n in codes if (self.workers[n].failure or (None,))[0] and self.workers[n].failure[0].kind == "bug"
        ]
        if not culprits:
            return None
        name = culprits[0]
        worker = self.workers[name]
        if worker.failure is None or worker.failure[0].kind != "bug":
            self._settle()  # the report is sent before the exit, over the same agent
        report = worker.failure[0] if worker.failure and worker.failure[0].kind == "bug" else None
        message = (
            f"{name} (rank {self.generation.members[name]}): the training code raised the same error again after a "
            f"replay of step {report.step + 1 if report else '?'}; no spare was spent on it"
        )
        error = report.error if report else f"(no traceback reported: see logs/{name}.log)"
        self.events.emit("job_abandoned", reason="training_code_error", message=message, error=error)
        self.stop()
        return JobOutcome(
            ok=False, exit_codes=self.exit_codes(), message=message, reason="training_code_error", error=error
        )

    def _past_progress_deadline(self) -> JobOutcome | None:
        """Whatever hang is left (a stall no rule blames, a generation that never forms) ends here: exit 4."""
        members = [self.workers[name] for name in self.generation.members]
        if any(w.position_generation != self.generation.number for w in members):
            return None  # still forming: bounded by the start and recovery timeouts
        step, at = self.last_commit
        since = max(at, *(w.active_since for w in members))
        if time.monotonic() - since <= self.ft.progress_deadline_s:
            return None
        missing = sorted(
            self.generation.members[name]
            for name in self.generation.members
            if (position := self.workers[name].position) is None
            or position.marker not in ("collective_entered", "collective_waiting")
            or position.step < step
        )
        message = (
            f"no step committed for {self.ft.progress_deadline_s:.0f} s (ft.progress_deadline_s) after step {step}; "
            f"rank(s) {missing} did not arrive at the collective"
        )
        self.events.emit("job_abandoned", reason="no_progress", message=message, missing_ranks=missing)
        self.stop()
        return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=message, reason="no_progress")

    def _settle(self) -> None:
        deadline = time.monotonic() + self.ft.settle_s
        while (left := deadline - time.monotonic()) > 0:
            self.wait_for_change(left)
            self._drain()

    def _detect_failures(self, codes: dict[str, int | None]) -> dict[str, dict]:
        """Members that died, went silent (fenced here), or reported an error, keyed by worker."""
        now = time.monotonic()
        for host in [h for h, record in self.hosts.items() if now - record.last_heard > self.ft.host_timeout_s]:
            self._host_lost(host, f"silent for {now - self.hosts[host].last_heard:.1f} s")
            codes = {n: self.workers[n].exit_code for n in codes}
        failures: dict[str, dict] = {}
        for name, code in codes.items():
            if self.workers[name].lost_with_host:
                failures[name] = _failure("host_lost", self.workers[name].lost_with_host, "host_timeout")
            elif code not in (None, 0):
                failures[name] = _failure("exit", describe_exit(code), "process_exit")
        if not self.ft.enabled:
            return failures
        alive = [n for n in self.generation.members if codes.get(n) is None and n not in failures]
        for name in alive:
            worker = self.workers[name]
            if not worker.pid:
                # Not forked yet (its agent's fork server may still be importing): bounded by the start timeout.
                if now - worker.started_at > self.spec.store_timeout_s:
                    failures[name] = _failure(
                        "start",
                        f"not started within {self.spec.store_timeout_s:.0f} s (cluster.start_timeout_s)",
                        "start_timeout",
                    )
                continue
            silent_s = now - max(worker.last_heard, worker.started_at)
            if silent_s > self.ft.heartbeat_timeout_s:
                self._fence(name)
                failures[name] = _failure("hang", f"no heartbeat for {silent_s:.1f} s", "heartbeat")
        if failures:
            return failures
        for name in self._stalled(now):
            self._fence(name)
            position = self.workers[name].position
            failures[name] = _failure(
                "stuck",
                f"alive but did not arrive at the collective of step {position.step + 1 if position else '?'}",
                "progress",
            )
        if failures:
            return failures
        reports = {
            name: self.workers[name].failure[0]
            for name in alive
            if self.workers[name].failure is not None
            and self.workers[name].failure[0].generation == self.generation.number
        }
        if not any(now - self.workers[name].failure[1] >= self.ft.settle_s for name in reports):
            return failures
        # A collective that failed because a peer raised and left it is that peer's failure, not a second one.
        causes = {name: r for name, r in reports.items() if r.kind != "collective"} or reports
        for name, report in causes.items():
            failures[name] = _failure(report.kind, report.error, "worker_report", lost=False)
        return failures

    def _stalled(self, now: float) -> list[str]:
        """Members blamed for a stalled step (see `protocol.blame_stalled`), from this generation's markers."""
        positions = {
            name: self.workers[name].position
            for name in self.generation.members
            if self.workers[name].position is not None
            and self.workers[name].position_generation == self.generation.number
        }
        if len(positions) < self.generation.world_size:
            return []  # the generation is still forming
        return blame_stalled(positions, now=now, stall_timeout_s=self.ft.stall_timeout_s)

    def _fence(self, name: str) -> None:
        """Make sure a worker declared failed can never act again before anyone replaces it: its agent kills it, and
        the next generation waits for the agent to confirm (bounded)."""
        worker = self.workers[name]
        self._retire(name)
        self._to_host(worker.host, FenceWorker(worker=name))
        deadline = time.monotonic() + 5.0
        while worker.exit_code is None and worker.host in self.hosts and time.monotonic() < deadline:
            self.wait_for_change(deadline - time.monotonic())
            self._drain()
        self.events.emit("worker_fenced", worker_name=name, exit_code=worker.exit_code)

    def _recover_from(self, failures: dict[str, dict]) -> JobOutcome | None:
        reached = max(self._progress().values(), default=0)
        for name, failure in failures.items():
            self.events.emit(
                "failure_detected",
                worker_name=name,
                failed_rank=self.generation.members[name],
                step=reached,
                generation=self.generation.number,
                **{k: v for k, v in failure.items() if k != "lost"},
            )
        now = time.time()
        failed_at = min(self.injected_at.pop(name, now) for name in failures)
        self.events.emit(
            "recovery_phase",
            phase="detect",
            generation=self.generation.number + 1,
            duration_s=now - failed_at,
            failed_at=failed_at,
            interrupted_step=reached + 1,
        )
        if reached > self.progress_at_last_failure:
            self.failures_without_progress = 0
        self.failures_without_progress += 1
        self.progress_at_last_failure = reached
        if self.failures_without_progress > self.ft.max_failures_without_progress:
            message = (
                f"{self.failures_without_progress} failures in a row without a committed step "
                f"(ft.max_failures_without_progress={self.ft.max_failures_without_progress}); giving up"
            )
            self.events.emit("job_abandoned", reason="no_progress", message=message)
            self.stop()
            return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=message, reason="no_progress")
        lost = [name for name, failure in failures.items() if failure["lost"]]
        for name in lost:
            self._retire(name)
        plan = replace_lost(
            self.generation.members,
            lost,
            self._ready_spares(),
            on_no_spare=self.ft.on_no_spare,
            largest_size=self._largest_size,
            layout=Layout(self.ft.shard),
        )
        for spare, rank in plan.promoted.items():
            self.spares_owed += 1
            self.events.emit("spare_promoted", worker_name=spare, promoted_rank=rank)
        if plan.abandon:
            self.events.emit("job_abandoned", reason="no_spare", message=plan.abandon)
            self.stop()
            return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=plan.abandon, reason="failed")
        if plan.wait:
            return self._wait_for_spares(plan.members, plan.vacant)
        if plan.shrunk_to:
            self.events.emit("job_shrunk", world_size=plan.shrunk_to, lost_ranks=plan.vacant, demoted=plan.demoted)
        self._publish_next(plan.members, reason="failure")
        return None

    def _publish_next(self, members: dict[str, int], *, reason: str) -> None:
        number = self.generation.number + 1
        self._publish(Generation(number=number, members=members, reason=reason, store_prefix=new_store_prefix(number)))

    def _wait_for_spares(self, members: dict[str, int], vacant: list[int]) -> JobOutcome | None:
        """ft.on_no_spare=wait: hold the job until spares fill the vacant ranks (bounded). Spares still starting
        count: a replacement is started for each vacancy beyond them (and for one that dies while starting)."""
        deadline = time.monotonic() + self.spec.store_timeout_s
        started: list[str] = []
        while time.monotonic() < deadline:
            for _ in vacant[len(self._spares()) :]:
                host = self._spare_host() or min(self.hosts, key=self._live_processes)
                started.append(self._start_worker(host, spare=True))
            ready = self._ready_spares()
            if len(ready) >= len(vacant):
                for rank, spare in zip(vacant, ready, strict=False):
                    members[spare] = rank
                    self.spares_owed += spare not in started  # one of the job's spares: replaced afterwards
                    self.events.emit("spare_promoted", worker_name=spare, promoted_rank=rank)
                self._publish_next(members, reason="failure")
                return None
            self.wait_for_change(0.1)
            self._drain()
        self.stop()
        return JobOutcome(
            ok=False,
            exit_codes=self.exit_codes(),
            reason="failed",
            message=f"no replacement became ready within {self.spec.store_timeout_s:.0f} s",
        )

    def _maybe_grow(self) -> None:
        """A shrunken job takes ready spares back at the next step boundary (a planned generation change)."""
        if self.generation.world_size >= self.spec.nproc or self._recovering():
            return
        ready = self._ready_spares()
        size = self._largest_size(min(self.spec.nproc, self.generation.world_size + len(ready)))
        if size <= self.generation.world_size:
            return
        grown = dict(self.generation.members)
        for spare in ready[: size - len(grown)]:
            grown[spare] = len(grown)
        self.spares_owed += size - self.generation.world_size
        self._publish_next(grown, reason="grow")

    def _largest_size(self, at_most: int) -> int:
        """The largest world size up to `at_most` that the job can run at (0: none)."""
        return max((size for size in range(1, at_most + 1) if self._can_run_at(size)), default=0)

    def _start_owed_spares(self) -> None:
        """Replace promoted spares once the recovery is over, so the new spare does not slow it down."""
        while self.spares_owed and not self._recovering() and (host := self._spare_host()) is not None:
            self.spares_owed -= 1
            self._start_worker(host, spare=True, background=True)

    def _spare_host(self) -> str | None:
        """The live host with the most free slots (None: every host is full; a replaced node will bring some)."""
        free = {h: self.hosts[h].capacity - self._live_processes(h) for h in self.hosts}
        best = max(free, key=free.get, default=None)
        return best if best is not None and free[best] > 0 else None

    def _live_processes(self, host: str) -> int:
        return sum(self.workers[n].alive for n in self.hosts[host].workers)

    def _replace_lost_spares(self) -> None:
        for name, worker in self.workers.items():
            if name not in self.generation.members and not worker.retired and worker.exit_code is not None:
                self._retire(name)
                self.events.emit("spare_lost", worker_name=name, detail=describe_exit(worker.exit_code))
                self.spares_owed += 1

    def _inject_faults(self) -> None:
        if not self.injector.active:
            return
        members = self.generation.members
        sender = next((n for n in members if self.workers[n].source_of == self.generation.number), None)
        progress = self._progress()
        strikes = self.injector.due(
            now=time.time(),
            members=members,
            progress=progress,
            spares=self._spares(),
            recovering=self._recovering(),
            sender=sender,
        )
        for strike in strikes:
            self.journal.write("fault_fired", event=asdict(strike.event), worker=strike.worker, t=time.time())
            if strike.event.kind == "kill_coordinator":
                self.events.emit(
                    "fault_injected",
                    kind="kill_coordinator",
                    signal="SIGKILL",
                    step=max(progress.values(), default=0) + 1,
                    generation=self.generation.number,
                    pid=os.getpid(),
                )
                os.kill(os.getpid(), signal.SIGKILL)  # this process: a restarted one takes over from the journal
            worker = self.workers[strike.worker]
            if strike.event.kind in HOST_KINDS:
                for name in self.hosts[worker.host].workers:
                    self.injected_at[name] = time.time()
                if self.strike_host is None:
                    raise NotImplementedError(f"this cluster cannot strike host {worker.host} ({strike.event.kind})")
                self.strike_host(strike.event, worker.host)
            else:
                self._to_host(worker.host, SignalWorker(worker=strike.worker, signum=strike.signum))
                self.injected_at[strike.worker] = time.time()
            self.events.emit(
                "fault_injected",
                kind=strike.event.kind,
                worker_name=strike.worker,
                target_rank=members.get(strike.worker),
                signal=signal_name(strike.signum) if strike.signum else "none",
                host=worker.host,
                step=progress.get(strike.worker, 0) + 1,
                generation=self.generation.number,
            )

    # --- helpers ----------------------------------------------------------------------------------------------

    def _progress(self) -> dict[str, int]:
        """Committed steps per member of the current generation (reports from older generations count too)."""
        return {n: self.workers[n].committed[1] for n in self.generation.members if self.workers[n].committed}

    def _recovering(self) -> bool:
        """True until every member of the current generation has committed a step in it."""
        return any((self.workers[n].committed or (0, 0))[0] != self.generation.number for n in self.generation.members)

    def _spares(self) -> list[str]:
        """Live workers that are not members of the current generation."""
        return [n for n, w in self.workers.items() if n not in self.generation.members and w.alive]

    def _ready_spares(self) -> list[str]:
        return [n for n in self._spares() if self.workers[n].ready]

    def _can_run_at(self, world_size: int) -> bool:
        if not Layout(self.ft.shard).can_run_at(world_size):
            return False
        return not self.ft.world_sizes or world_size in self.ft.world_sizes

    def exit_codes(self) -> dict[str, int | None]:
        return {name: w.exit_code for name, w in self.workers.items()}

    def request_stop(self) -> None:
        """Preemption: every worker stops cleanly at the same step boundary (writing a final checkpoint when
        checkpoints are enabled) and exits; keep polling for the outcome.

        The boundary is two steps past the most advanced progress report: a worker reports each step before it
        checks for a stop, so none can have passed that boundary unseen, and all of them stop there together
        (workers stopping one step apart would leave the others blocked in a collective)."""
        self._drain()
        stop_at = max(self._progress().values(), default=0) + 2
        for host in self.hosts:
            self._to_host(host, StopAt(step=stop_at))
        self.events.emit("stop_requested", stop_at=stop_at)

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, waking at once when an agent reports anything (a worker's exit among it)."""
        self.control.wait(timeout_s)

    def wait(self, *, poll_interval_s: float = 0.05) -> JobOutcome:
        while (outcome := self.poll()) is None:
            self.wait_for_change(poll_interval_s)
        return outcome

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Every agent kills what is left on its host and exits (a clean stop is `request_stop`)."""
        self.ending = True
        for host in list(self.hosts):
            self._to_host(host, Shutdown(reason="job ended"))
        deadline = time.monotonic() + timeout_s
        while self.hosts and time.monotonic() < deadline:
            self.wait_for_change(deadline - time.monotonic())
            self._drain()

    def close(self) -> None:
        self._closed.set()
        if self.spec is not None:
            self.stop()
        self.control.close()
        if self.events is not None:
            self.events.close()
        if self.journal is not None:
            self.journal.close()
        self.store = None

    def _to_host(self, host: str, message) -> None:
        if host not in self.hosts:
            return
        try:
            self.hosts[host].channel.send(message)
        except ChannelClosed:
            self.control.put(host, None)


def _failure(kind: str, detail: str, detected_by: str, *, lost: bool = True) -> dict:
    """A failure as `failure_detected` records it; `lost`: the worker is gone (else it reported and can rejoin)."""
    return {"kind": kind, "detail": detail, "detected_by": detected_by, "lost": lost}


def _bound_store(
    address: str, *, timeout_s: float, sock: socket.socket | None = None
) -> tuple[dist.TCPStore, socket.socket]:
    """The c10d store, listening on `address` only (its own bind would take every interface), or on the listening
    socket `sock`; keep the socket open as long as the store."""
    sock = sock or socket.create_server((address, 0), backlog=1024)
    store = dist.TCPStore(
        address,
        sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
        timeout=timedelta(seconds=timeout_s),
    )
    return store, sock
