"""The coordinator: one per job. It admits the node agents, decides which worker holds which rank, detects failures
from what the agents relay, fences the culprit through its agent, promotes a spare or shrinks the job, and publishes
the next generation. It also hosts the c10d store, which serves only the collective backend's rendezvous.

Its parts, each a module: who is in the job (`membership`, journaled, with its replay), the agents' side of the
channels (`agent_channels`), the rules that find a failure (`detection`: exits, silence, stalls, reports), and the
replacement policy (`replacement`). This module runs the job with them: start or resume, one look at a time (`poll`),
recovery from what the rules found, spares kept up, and the end. Fault injection drives it from outside
(`fault_driver`).

It never touches a worker directly: every start, signal and fence goes through the worker's agent. `cluster=local`
is this with one agent on this machine (`LocalCluster`).

It may die: every decision goes to its journal (`journal.py`) before anyone hears of it, and a coordinator started
afresh on the same address and port (`resume`) rebuilds its view from the journal and from what the agents, which
keep their workers and reconnect, resend. Steps whose collectives succeed need no coordinator meanwhile.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace

from ckptless_core.agent_channels import AgentChannels, build_host_job
from ckptless_core.control_server import ControlServer
from ckptless_core.coordinator_link import RECONNECT_CONNECT_S
from ckptless_core.detection import (
    Failure,
    bug_report,
    find_failures,
    missed_progress_deadline,
    training_code_culprit,
)
from ckptless_core.events import EventLog
from ckptless_core.job import JobOutcome, JobSpec, describe_exit
from ckptless_core.journal import Journal, journal_path, read_journal
from ckptless_core.layout import Layout
from ckptless_core.membership import Membership
from ckptless_core.moves import start_drains, watch_departures
from ckptless_core.protocol import FenceWorker, Generation, StartWorker, StopAt, new_store_prefix
from ckptless_core.rendezvous_store import RendezvousStore
from ckptless_core.replacement import grow, largest_size, replace_lost
from ckptless_core.stragglers import watch_stragglers


class Coordinator:
    """Runs one job over its agents; `start()` (or `resume()`), then `poll()` until it returns an outcome."""

    def __init__(
        self,
        *,
        secret: bytes,
        bind_address: str = "127.0.0.1",
        port: int = 0,
        listener: socket.socket | None = None,
        store_socket: socket.socket | None = None,
    ) -> None:
        """`listener`, `store_socket`: listening sockets to serve the control channels and the store on (a restarted
        coordinator takes over its predecessor's)."""
        self.secret = secret
        self.bind_address = bind_address
        self.control = ControlServer(secret=secret, bind_address=bind_address, port=port, listener=listener)
        self.address = self.control.address
        self._store_socket = store_socket
        self.spec: JobSpec | None = None
        self.events: EventLog | None = None
        self.journal: Journal | None = None
        self.journal_records: list[dict] = []
        """What the journal held when this coordinator resumed (empty: it started the job)."""
        self.membership: Membership | None = None
        self.channels: AgentChannels | None = None
        self.store: RendezvousStore | None = None
        self.failures_without_progress = 0
        self.progress_at_last_failure = -1
        self.fault_times: dict[str, float] = {}
        """When a fault was injected into a worker (wall clock): its failure is timed from then (`note_fault_time`)."""
        self.stop_requested = False
        self.stragglers: set[str] = set()
        """Members reported as stragglers (`stragglers`)."""
        self.stop_reason: str | None = None
        """Why this coordinator stopped the job itself (every host leaving); None: it did not."""

    # --- start ------------------------------------------------------------------------------------------------

    def _open(self, spec: JobSpec) -> None:
        self.spec = spec
        self.ft = spec.ft
        self.per_host = -(-spec.nproc // spec.num_hosts)
        self.events = EventLog(spec.run_dir / "events" / "coordinator.jsonl", worker="coordinator")
        self.journal = Journal(journal_path(spec.run_dir))
        self.membership = Membership(journal=self.journal, events=self.events, num_hosts=spec.num_hosts)
        self.store = RendezvousStore(self.bind_address, timeout_s=spec.store_timeout_s, sock=self._store_socket)
        self.channels = AgentChannels(
            self.control,
            self.membership,
            events=self.events,
            host_job=build_host_job(spec, store_address=self.bind_address, store_port=self.store.port),
            config_sha256=spec.config_sha256,
            per_host=self.per_host,
        )

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
        membership = self.membership
        deadline = time.monotonic() + spec.store_timeout_s
        expected = spec.num_hosts + spec.spare_hosts
        while len(membership.hosts) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(membership.hosts)} of {expected} node agents joined within {spec.store_timeout_s:.0f} s"
                )
            self.wait_for_change(0.1)
            self.channels.drain()
        names = sorted(membership.hosts)
        membership.set_hosts(names)
        training_hosts, spare_hosts = membership.training_hosts, names[spec.num_hosts :]
        members = {}
        for rank in range(spec.nproc):
            members[self._start_worker(training_hosts[rank // self.per_host], spare=False)] = rank
        self._publish(Generation(number=1, members=members, reason="start", store_prefix=new_store_prefix(1)))
        if self.ft.enabled:
            for i in range(self.ft.spares):
                self._start_worker(training_hosts[i % len(training_hosts)], spare=True)
            for host in spare_hosts:
                for _ in range(self.per_host):
                    self._start_worker(host, spare=True)
        for host in membership.hosts.values():
            membership.set_capacity(host.name, len(host.workers))

    def resume(self, spec: JobSpec) -> None:
        """Take over a running job after the coordinator before this one died: replay the journal, wait (bounded)
        for every host's agent to reconnect and resend what it knows; a host that does not is lost. A generation
        that was still forming is published again under a new number: its rendezvous keys died with the old
        store."""
        self._open(spec)
        membership = self.membership
        self.journal_records = read_journal(journal_path(spec.run_dir))
        for record in self.journal_records:
            membership.replay(record)
        self.events.emit(
            "coordinator_resumed",
            generation=membership.generation.number,
            journal_records=len(self.journal_records),
            port=self.address[1],
            pid=os.getpid(),
        )
        expected = set(membership.journaled_hosts) - membership.lost_hosts
        # An agent may be in a try on the dead coordinator's address (RECONNECT_CONNECT_S at most) before it reads
        # this one's; under load its next try and its resend take a few seconds more.
        deadline = time.monotonic() + max(3 * RECONNECT_CONNECT_S, 3 * self.ft.host_timeout_s)
        while not all(h in membership.hosts and membership.hosts[h].resent for h in expected):
            if time.monotonic() > deadline:
                break
            self.wait_for_change(0.1)
            self.channels.drain()
        for host in sorted(expected):
            if host not in membership.hosts or not membership.hosts[host].resent:
                self.channels.lose_host(host, "its agent did not reconnect to the restarted coordinator")
        members = membership.generation.members
        if membership.recovering() and all(membership.workers[n].alive for n in members):
            self._publish_next(dict(members), reason="coordinator_restart")

    def _start_worker(self, host: str, *, spare: bool, background: bool = False) -> str:
        name = self.membership.add_worker(host, spare=spare)
        self.channels.to_host(host, StartWorker(worker=name, spare=spare, background=background))
        return name

    def _publish(self, generation: Generation) -> None:
        generation = replace(generation, store_address=self.bind_address, store_port=self.store.port)
        self.membership.set_generation(generation)
        # Counted before anyone hears of it: once sent, its members' rendezvous keys arrive at their own pace.
        # The previous generation's keys may still be read by a worker leaving it.
        self.store.forget_before(generation.number - 1)
        store_keys = self.store.num_keys()
        self.channels.to_every_host(generation)
        self.events.emit(
            "generation_started",
            generation=generation.number,
            members=generation.members,
            world_size=generation.world_size,
            reason=generation.reason,
            store_keys=store_keys,
        )

    def _publish_next(self, members: dict[str, int], *, reason: str) -> None:
        number = self.membership.generation.number + 1
        self._publish(Generation(number=number, members=members, reason=reason, store_prefix=new_store_prefix(number)))

    # --- watch ------------------------------------------------------------------------------------------------

    def poll(self) -> JobOutcome | None:
        """None while the job runs; the outcome once every member finished, or the job cannot go on."""
        self.channels.drain()
        membership = self.membership
        if self.stop_reason is None and membership.every_host_leaving():
            self.stop_reason = "every host is leaving (SIGTERM to its agent): no host is left to train on"
            self.request_stop()
        codes = membership.exit_codes(membership.generation.members)
        if codes and all(code == 0 for code in codes.values()):
            self.events.emit("job_completed", generation=membership.generation.number)
            self.stop()
            if self.stop_reason is not None:
                return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=self.stop_reason, reason="stopped")
            return JobOutcome(ok=True, exit_codes=self.exit_codes(), message="all workers completed")
        if (outcome := self._training_code_error()) is not None:
            return outcome
        if (outcome := self._past_progress_deadline()) is not None:
            return outcome
        failures = self._detect_failures()
        if failures and 0 in codes.values():
            # A member completed every step, so every collective of the run completed: what failed since is the
            # end of a worker, not of the training.
            self.events.emit("job_completed", generation=membership.generation.number)
            self.stop()
            message = f"all steps completed; then {', '.join(sorted(failures))} failed"
            return JobOutcome(ok=True, exit_codes=self.exit_codes(), message=message)
        if failures:
            if not self.ft.enabled:
                self._settle()  # let failures that happen together all surface before reporting
                failures = self._detect_failures()
                self.stop()
                # A worker killed by a signal is the likely cause; peers that then exited with an error follow.
                ordered = sorted(failures.items(), key=lambda kv: not kv[1].detail.startswith("killed"))
                message = "; ".join(f"{name} failed ({failure.detail})" for name, failure in ordered)
                return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=message, reason="failed")
            outcome = self._recover_from(failures)
            if outcome is not None:
                return outcome
        if self.ft.enabled and 0 not in codes.values():  # (no spare is started for a job whose training is done)
            watch_departures(self)
            start_drains(self)
            watch_stragglers(self)
            self._replace_lost_spares()
            self._maybe_grow()
            self._start_owed_spares()
        return None

    def _detect_failures(self) -> dict[str, Failure]:
        """Members that died, went silent (fenced here), stalled a step (fenced) or reported an error (`detection`)."""
        now = time.monotonic()
        self.channels.lose_silent_hosts(now=now, timeout_s=self.ft.host_timeout_s)
        return find_failures(
            self.membership, self.ft, now=now, start_timeout_s=self.spec.store_timeout_s, fence=self._fence
        )

    def _training_code_error(self) -> JobOutcome | None:
        """A member whose training code raised the same error again after a replay ends the job at once: a bug is
        not a failure, and no spare is spent on it. The traceback comes with its report."""
        name = training_code_culprit(self.membership)
        if name is None:
            return None
        if bug_report(self.membership, name) is None:
            self._settle()  # the report is sent before the exit, over the same agent
        report = bug_report(self.membership, name)
        message = (
            f"{name} (rank {self.membership.generation.members[name]}): the training code raised the same error "
            f"again after a replay of step {report.step + 1 if report else '?'}; no spare was spent on it"
        )
        error = report.error if report else f"(no traceback reported: see logs/{name}.log)"
        self.events.emit("job_abandoned", reason="training_code_error", message=message, error=error)
        self.stop()
        return JobOutcome(
            ok=False, exit_codes=self.exit_codes(), message=message, reason="training_code_error", error=error
        )

    def _past_progress_deadline(self) -> JobOutcome | None:
        """Whatever hang is left (a stall no rule blames, a generation that never forms) ends here: exit 4."""
        deadline_s = self.ft.progress_deadline_s
        missing = missed_progress_deadline(self.membership, now=time.monotonic(), deadline_s=deadline_s)
        if missing is None:
            return None
        message = (
            f"no step committed for {deadline_s:.0f} s (ft.progress_deadline_s) after step "
            f"{self.membership.last_commit[0]}; rank(s) {missing} did not arrive at the collective"
        )
        self.events.emit("job_abandoned", reason="no_progress", message=message, missing_ranks=missing)
        self.stop()
        return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=message, reason="no_progress")

    def _settle(self) -> None:
        deadline = time.monotonic() + self.ft.settle_s
        while (left := deadline - time.monotonic()) > 0:
            self.wait_for_change(left)
            self.channels.drain()

    def _fence(self, name: str) -> None:
        """Make sure a worker declared failed can never act again before anyone replaces it: its agent kills it, and
        the next generation waits for the agent to confirm (bounded)."""
        worker = self.membership.workers[name]
        self.membership.retire(name)
        self.channels.to_host(worker.host, FenceWorker(worker=name))
        deadline = time.monotonic() + 5.0
        while worker.exit_code is None and worker.host in self.membership.hosts and time.monotonic() < deadline:
            self.wait_for_change(deadline - time.monotonic())
            self.channels.drain()
        self.events.emit("worker_fenced", worker_name=name, exit_code=worker.exit_code)

    def note_fault_time(self, worker: str, at: float) -> None:
        """`worker` was struck by an injected fault at `at` (wall clock): the failure it causes is timed from then,
        not from when it was found."""
        self.fault_times[worker] = at

    # --- recover ----------------------------------------------------------------------------------------------

    def _recover_from(self, failures: dict[str, Failure]) -> JobOutcome | None:
        membership = self.membership
        generation = membership.generation
        reached = max(membership.progress().values(), default=0)
        for name, failure in failures.items():
            self.events.emit(
                "failure_detected",
                worker_name=name,
                failed_rank=generation.members[name],
                step=reached,
                generation=generation.number,
                **failure.event_fields(),
            )
        # Timed from the earliest last sign of life of what failed (an injected fault's moment, when earlier).
        now, clock = time.time(), time.monotonic()
        injected = {name: self.fault_times.pop(name, now) for name in failures}
        failed_at = min(min(injected[name], now - (clock - f.last_seen)) for name, f in failures.items())
        self.events.emit(
            "recovery_phase",
            phase="detect",
            generation=generation.number + 1,
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
        lost = [name for name, failure in failures.items() if failure.lost]
        for name in lost:
            membership.retire(name)
        plan = replace_lost(
            generation.members,
            lost,
            membership.ready_spares(),
            on_no_spare=self.ft.on_no_spare,
            largest_size=self._largest_size,
            layout=Layout(self.ft.shard),
        )
        for spare, rank in plan.promoted.items():
            membership.spares_owed += 1
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

    def _wait_for_spares(self, members: dict[str, int], vacant: list[int]) -> JobOutcome | None:
        """ft.on_no_spare=wait: hold the job until spares fill the vacant ranks (bounded). Spares still starting
        count: a replacement is started for each vacancy beyond them (and for one that dies while starting)."""
        membership = self.membership
        deadline = time.monotonic() + self.spec.store_timeout_s
        started: list[str] = []
        while time.monotonic() < deadline:
            for _ in vacant[len(membership.spares()) :]:
                host = membership.spare_host() or min(membership.hosts, key=membership.live_processes)
                started.append(self._start_worker(host, spare=True))
            ready = membership.ready_spares()
            if len(ready) >= len(vacant):
                for rank, spare in zip(vacant, ready, strict=False):
                    members[spare] = rank
                    membership.spares_owed += spare not in started  # one of the job's spares: replaced afterwards
                    self.events.emit("spare_promoted", worker_name=spare, promoted_rank=rank)
                self._publish_next(members, reason="failure")
                return None
            self.wait_for_change(0.1)
            self.channels.drain()
        self.stop()
        return JobOutcome(
            ok=False,
            exit_codes=self.exit_codes(),
            reason="failed",
            message=f"no replacement became ready within {self.spec.store_timeout_s:.0f} s",
        )

    def _maybe_grow(self) -> None:
        """A shrunken job takes ready spares back at the next step boundary (a planned generation change)."""
        membership = self.membership
        if membership.recovering():
            return
        members = membership.generation.members
        grown = grow(members, membership.ready_spares(), nproc=self.spec.nproc, largest_size=self._largest_size)
        if grown is None:
            return
        membership.spares_owed += len(grown) - len(members)
        self._publish_next(grown, reason="grow")

    def _largest_size(self, at_most: int) -> int:
        return largest_size(at_most, layout=Layout(self.ft.shard), world_sizes=self.ft.world_sizes)

    def _start_owed_spares(self) -> None:
        """Replace promoted spares once the recovery is over, so the new spare does not slow it down."""
        membership = self.membership
        while membership.spares_owed and not membership.recovering() and (host := membership.spare_host()) is not None:
            membership.spares_owed -= 1
            self._start_worker(host, spare=True, background=True)

    def _replace_lost_spares(self) -> None:
        membership = self.membership
        for name, worker in membership.workers.items():
            if name not in membership.generation.members and not worker.retired and worker.exit_code is not None:
                membership.retire(name)
                self.events.emit("spare_lost", worker_name=name, detail=describe_exit(worker.exit_code))
                membership.spares_owed += 1

    # --- end --------------------------------------------------------------------------------------------------

    def exit_codes(self) -> dict[str, int | None]:
        return self.membership.exit_codes() if self.membership is not None else {}

    def request_stop(self) -> None:
        """Preemption: every worker stops cleanly at the same step boundary (writing a final checkpoint when
        checkpoints are enabled) and exits; keep polling for the outcome.

        The boundary is two steps past the most advanced progress report: a worker reports each step before it
        checks for a stop, so none can have passed that boundary unseen, and all of them stop there together
        (workers stopping one step apart would leave the others blocked in a collective)."""
        if self.stop_requested:  # one boundary for every worker: a second, later one could split them
            return
        self.stop_requested = True
        self.channels.drain()
        stop_at = max(self.membership.progress().values(), default=0) + 2
        self.channels.to_every_host(StopAt(step=stop_at))
        self.events.emit("stop_requested", stop_at=stop_at)

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, waking at once when an agent reports anything (a worker's exit among it)."""
        self.control.wait(timeout_s)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Every agent kills what is left on its host and exits (a clean stop is `request_stop`)."""
        self.channels.shut_down(timeout_s=timeout_s)

    def close(self) -> None:
        if self.channels is not None:
            self.channels.stop_heartbeat()
            self.stop()
        self.control.close()
        if self.events is not None:
            self.events.close()
        if self.journal is not None:
            self.journal.close()
        self.store = None
