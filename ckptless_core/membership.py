"""Who is in the job, as the coordinator sees it: the hosts, every worker it ordered (member, spare or gone) with
what it last reported, and the current generation. Every decision is journaled (`journal.py`) before anyone hears
of it; `replay` rebuilds the view from the journal in a restarted coordinator. The questions the coordinator's rules
ask (who progressed how far, is a generation still forming, which spares are ready, where a spare fits) are answered
here, from the records alone.
"""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass, field

from ckptless_core.events import EventLog
from ckptless_core.journal import Journal
from ckptless_core.protocol import (
    LEAVE_GRACE_S,
    FailureReport,
    Generation,
    Heartbeat,
    Leaving,
    Position,
    Progress,
    Ready,
    Resent,
    SourceAnnounced,
    WorkerExited,
    WorkerStarted,
)

COMPUTE_KEPT = 256
"""Steps of compute times kept per worker: the longest straggler window (`ft.straggler_window_steps`)."""


@dataclass
class WorkerRecord:
    name: str
    host: str
    spare: bool
    started_at: float
    """Coordinator's monotonic clock, like every time below."""
    pid: int = 0
    exit_code: int | None = None
    retired: bool = False
    """No longer part of the job: a lost member, a lost spare, a fenced worker, or one that departs in a move."""
    departing: bool = False
    """It hands its rank over in a planned move (`moves`): it trains on until the step boundary, unheeded."""
    last_heard: float = 0.0
    spoke: bool = False
    """The worker itself sent something (a heartbeat, ...): until then it starts (imports, builds its model)."""
    ready: bool = False
    committed: tuple[int, int] | None = None
    """(generation, steps committed) of the latest `committed` marker."""
    position: Position | None = None
    position_generation: int = 0
    active_since: float = 0.0
    """When its first progress marker of `position_generation` arrived."""
    lost_with_host: str = ""
    """Why this worker is gone with its host (empty: it is not)."""
    host_last_heard: float = 0.0
    """A worker gone with its host: when the host last gave a sign of life (its last message, or its channel's
    close), the moment its failure is timed from."""
    failure: tuple[FailureReport, float] | None = None
    source_of: int = 0
    """The generation this worker announced itself as the state source of."""
    compute_s: dict[int, float] = field(default_factory=dict)
    """Its compute before the first collective, per step committed (`Progress.compute_s`), the last COMPUTE_KEPT."""

    @property
    def alive(self) -> bool:
        return self.exit_code is None and not self.retired


@dataclass
class HostRecord:
    name: str
    channel: object
    last_heard: float
    workers: list[str] = field(default_factory=list)
    capacity: int = 0
    """Processes the host runs at most: what it was given at the start, or `nproc_per_host` for a host that joins
    a running job (a replaced node); replacement spares go where a slot is free."""
    resent: bool = True
    """False while an agent that reconnected to a restarted coordinator resends its reports."""
    leaving: bool = False
    """Its agent got SIGTERM (`Leaving`), or an operator drains it (`Drain`): the host goes unless the job stops
    first."""
    leaving_at: float = 0.0
    """When its leaving counts from: a SIGTERM's `LEAVE_GRACE_S` later, a drain's at once."""
    handed_over: bool = False
    """The move of its ranks was published (or it had none): nothing more to decide for it."""


class Membership:
    def __init__(self, *, journal: Journal, events: EventLog, num_hosts: int) -> None:
        self.journal = journal
        self.events = events
        self.num_hosts = num_hosts
        self.hosts: dict[str, HostRecord] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self.generation = Generation()
        self.training_hosts: list[str] = []
        self.lost_hosts: set[str] = set()
        """Hosts declared lost: an agent of one that comes back is refused (its workers were replaced)."""
        self.journaled_hosts: dict[str, int] = {}
        """Resuming: host -> capacity, as the journal has them."""
        self.next_worker_id = 0
        self._spares_owed = 0
        self.last_commit: tuple[int, float] = (0, time.monotonic())
        """(highest step committed by any member, when it arrived)."""

    # --- decisions, journaled first ----------------------------------------------------------------------------

    @property
    def spares_owed(self) -> int:
        """Spares promoted or lost and not replaced yet."""
        return self._spares_owed

    @spares_owed.setter
    def spares_owed(self, value: int) -> None:
        self._spares_owed = value
        self.journal.write("spares_owed", value=value)

    def set_hosts(self, names: list[str]) -> None:
        """The hosts the job started on, sorted: the first `num_hosts` train, the rest hold spares."""
        self.journal.write("hosts", names=names)
        self.training_hosts = names[: self.num_hosts]

    def set_capacity(self, host: str, capacity: int) -> None:
        self.hosts[host].capacity = capacity
        self.journal.write("host", name=host, capacity=capacity)

    def add_worker(self, host: str, *, spare: bool) -> str:
        """A new worker's name, recorded on `host` (the order to start it is the caller's to send)."""
        name = f"worker{self.next_worker_id}"
        self.next_worker_id += 1
        self.journal.write("worker", name=name, host=host, spare=spare)
        self.workers[name] = WorkerRecord(name=name, host=host, spare=spare, started_at=time.monotonic())
        self.hosts[host].workers.append(name)
        return name

    def retire(self, name: str) -> None:
        self.workers[name].retired = True
        self.journal.write("retired", name=name)

    def set_generation(self, generation: Generation) -> None:
        self.journal.write("generation", **asdict(generation))
        self.generation = generation

    def lose_host(self, host: str, detail: str, *, last_heard: float) -> HostRecord | None:
        """Declare `host` lost with every process on it, last heard from at `last_heard`; returns its record (None:
        it was not connected)."""
        self.journal.write("host_lost", name=host)
        self.lost_hosts.add(host)
        lost = self.hosts.pop(host, None)
        for worker in self.workers.values():
            if worker.host == host and worker.exit_code is None:
                worker.exit_code = -signal.SIGKILL
                worker.lost_with_host = f"host {host} lost: {detail}"
                worker.host_last_heard = last_heard
        return lost

    def leave(self, host: str, *, at: float, why: str) -> None:
        """`host` leaves the job from `at` on (coordinator's clock) unless the job stops first; `why`: `signal` (its
        agent got SIGTERM) or `command` (`python -m launcher drain`)."""
        record = self.hosts[host]
        if not record.leaving:
            record.leaving, record.leaving_at = True, at
            self.events.emit("leaving_announced", host=host, by=why)

    def replay(self, record: dict) -> None:
        """One journal record, as a restarted coordinator reads it (records of other owners are skipped)."""
        op = record["op"]
        if op == "hosts":
            self.journaled_hosts = dict.fromkeys(record["names"], 0)
            self.training_hosts = record["names"][: self.num_hosts]
        elif op == "host":
            self.journaled_hosts[record["name"]] = record["capacity"]
        elif op == "worker":
            name = record["name"]
            self.workers[name] = WorkerRecord(
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

    # --- what the agents relay ---------------------------------------------------------------------------------

    def record(self, host: str, message, received_at: float) -> None:
        """A worker's report (or its agent's word of it), relayed by `host`'s agent; or the agent's own word."""
        if isinstance(message, Resent):
            self._resent(host, message)
            return
        if isinstance(message, Leaving):
            self.leave(host, at=received_at + LEAVE_GRACE_S, why="signal")
            return
        worker = self.workers.get(getattr(message, "worker", ""))
        if worker is not None and worker.departing and not isinstance(message, WorkerExited):
            return  # (it reports until its step boundary: nothing to decide from it)
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
        worker.spoke |= not isinstance(message, (WorkerStarted, WorkerExited))
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
            self._progressed(worker, message, received_at)
        elif isinstance(message, FailureReport):
            worker.failure = (message, received_at)
        elif isinstance(message, SourceAnnounced):
            worker.source_of = message.generation

    def _progressed(self, worker: WorkerRecord, message: Progress, received_at: float) -> None:
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
            if message.compute_s > 0:
                worker.compute_s[message.step] = message.compute_s
                worker.compute_s.pop(message.step - COMPUTE_KEPT, None)
            if message.step > self.last_commit[0]:
                self.last_commit = (message.step, received_at)

    def _resent(self, host: str, message: Resent) -> None:
        """A reconnected agent resent all it holds: a worker the journal places on its host that it never started
        (the coordinator died between journaling the order and sending it) is gone."""
        self.hosts[host].resent = True
        for name in self.hosts[host].workers:
            worker = self.workers[name]
            if name not in message.workers and worker.exit_code is None:
                worker.exit_code = -signal.SIGKILL
                worker.lost_with_host = f"never started on host {host}: the coordinator died before ordering it"
                worker.host_last_heard = time.monotonic()
        self.events.emit("agent_resent", host=host, workers=message.workers)

    # --- questions the rules ask -------------------------------------------------------------------------------

    def exit_codes(self, names=None) -> dict[str, int | None]:
        """Exit code per worker (None: running) of `names`, or of every worker."""
        return {name: self.workers[name].exit_code for name in (self.workers if names is None else names)}

    def progress(self) -> dict[str, int]:
        """Committed steps per member of the current generation (reports from older generations count too)."""
        return {n: self.workers[n].committed[1] for n in self.generation.members if self.workers[n].committed}

    def steps_entered(self) -> dict[str, int]:
        """Per member, the step (1-based) it is in, or last committed if it has not entered the next one yet."""
        entered = {}
        for name in self.generation.members:
            position = self.workers[name].position
            if position is not None:
                entered[name] = position.step + (position.marker != "committed")
        return entered

    def recovering(self) -> bool:
        """True until every member of the current generation has committed a step in it."""
        return any((self.workers[n].committed or (0, 0))[0] != self.generation.number for n in self.generation.members)

    def spares(self) -> list[str]:
        """Live workers that are not members of the current generation."""
        return [n for n, w in self.workers.items() if n not in self.generation.members and w.alive]

    def ready_spares(self) -> list[str]:
        return [n for n in self.spares() if self.workers[n].ready]

    def state_sender(self) -> str | None:
        """The member announced as the state source of the current generation, if one was."""
        members = self.generation.members
        return next((n for n in members if self.workers[n].source_of == self.generation.number), None)

    def live_processes(self, host: str) -> int:
        return sum(self.workers[n].alive for n in self.hosts[host].workers)

    def every_host_leaving(self) -> bool:
        """Every host still in the job is leaving: none would be left to train on."""
        return bool(self.hosts) and all(host.leaving for host in self.hosts.values())

    def spare_host(self) -> str | None:
        """The live host with the most free slots (None: every host is full; a replaced node will bring some)."""
        free = {h: self.hosts[h].capacity - self.live_processes(h) for h in self.hosts if not self.hosts[h].leaving}
        best = max(free, key=free.get, default=None)
        return best if best is not None and free[best] > 0 else None
