"""The coordinator's side of its channels to the node agents: admitting an agent (or refusing it, saying why and
how to fix it), reading what the agents relay into the membership, sending orders to a host, a heartbeat every agent
hears (its host's lease), and losing a host whose channel closed or fell silent, with every process on it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict

from ckptless_core.control_server import ControlServer, Refusal
from ckptless_core.events import EventLog
from ckptless_core.job import JobSpec
from ckptless_core.membership import HostRecord, Membership
from ckptless_core.protocol import (
    PROTOCOL_VERSION,
    ChannelClosed,
    CoordinatorHeartbeat,
    Drain,
    Hello,
    HostHeartbeat,
    HostJob,
    Refused,
    Shutdown,
    Welcome,
)


def build_host_job(spec: JobSpec, *, store_address: str, store_port: int) -> HostJob:
    """What every agent of the job is told to run (its Welcome): the entry, the run directory, and every worker's
    environment, torchrun-compatible (a worker's rank comes from the generation it joins) plus the store's address."""
    env = {
        **spec.env,
        "RANK": "-1",
        "WORLD_SIZE": str(spec.nproc),
        "LOCAL_WORLD_SIZE": str(spec.nproc),
        "MASTER_ADDR": store_address,
        "MASTER_PORT": str(store_port),
        "CKPTLESS_SUPERVISED": "1",
        "CKPTLESS_RUN_DIR": str(spec.run_dir),
        "OMP_NUM_THREADS": str(spec.threads_per_worker),
    }
    return HostJob(
        entry=spec.entry,
        run_dir=str(spec.run_dir),
        env=env,
        threads_per_worker=spec.threads_per_worker,
        preload=list(spec.preload),
        heartbeat_interval_s=min(0.25, spec.ft.host_timeout_s / 8),
        coordinator_timeout_s=spec.ft.coordinator_timeout_s,
        lease_s=spec.ft.lease_s,
        host_timeout_s=spec.ft.host_timeout_s,
        drain_timeout_s=spec.ft.drain_timeout_s,
    )


class AgentChannels:
    def __init__(
        self,
        control: ControlServer,
        membership: Membership,
        *,
        events: EventLog,
        host_job: HostJob,
        config_sha256: str,
        per_host: int,
    ) -> None:
        """`host_job`: what every admitted agent is told to run; `config_sha256`: the job's config, which an agent's
        run directory must hold; `per_host`: the slots of a host that joins a running job (a replaced node)."""
        self.control = control
        self.membership = membership
        self.events = events
        self.host_job = host_job
        self.config_sha256 = config_sha256
        self.per_host = per_host
        self.ending = False
        """Every agent was told to shut down: a host that leaves now is done, not lost."""
        self._closed = threading.Event()
        threading.Thread(target=self._beat, name="coordinator-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        """Every agent hears from the coordinator at least every heartbeat interval, from a thread of its own (the
        main loop may wait on a fence): the lease of its host holds (see `agent`)."""
        while not self._closed.wait(self.host_job.heartbeat_interval_s):
            for host in list(self.membership.hosts.values()):
                try:
                    host.channel.send(CoordinatorHeartbeat(generation=self.membership.generation.number))
                except (ChannelClosed, OSError):
                    pass  # the main loop learns of it from the channel's reader

    def drain(self) -> None:
        """Take in everything that arrived: agents joining, their reports, channels closed."""
        for host, message, received_at in self.control.messages():
            if isinstance(message, Refusal):
                self.events.emit("control_refused", peer=message.peer, reason=message.reason)
            elif isinstance(message, Hello):
                self._admit(message, host)
            elif isinstance(message, Drain):
                self._drain_host(message, host)
            elif message is None:
                self.lose_host(host, "its agent's channel closed", last_heard=received_at)
            elif host in self.membership.hosts:
                self.membership.hosts[host].last_heard = received_at
                if not isinstance(message, HostHeartbeat):
                    self.membership.record(host, message, received_at)

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, waking at once when an agent reports anything (a worker's exit among it)."""
        self.control.wait(timeout_s)

    def _admit(self, hello: Hello, channel) -> None:
        membership = self.membership
        reason = self._refusal(hello)
        if reason:
            self.events.emit("agent_refused", host=hello.name, reason=reason)
            try:
                channel.send(Refused(reason=reason))
            except ChannelClosed:
                pass
            channel.close()
            return
        rejoining = hello.name in membership.journaled_hosts
        if not rejoining:
            membership.journal.write(
                "host", name=hello.name, capacity=self.per_host if membership.generation.number else 0
            )
        try:
            channel.send(Welcome(job=asdict(self.host_job)))
        except ChannelClosed:
            return
        host = membership.hosts[hello.name] = HostRecord(name=hello.name, channel=channel, last_heard=time.monotonic())
        self.events.emit("agent_joined", host=hello.name, pid=hello.pid, rejoined=rejoining)
        self.control.serve(hello.name, channel)
        if rejoining:
            # Its workers, as the journal has them; what became of each arrives with the agent's resent reports.
            host.capacity = membership.journaled_hosts[hello.name]
            host.workers = [n for n, w in membership.workers.items() if w.host == hello.name]
            host.resent = False
            self.to_host(hello.name, membership.generation)
        elif membership.generation.number:
            host.capacity = self.per_host  # a replaced node: its slots take the spares owed

    def _drain_host(self, request: Drain, channel) -> None:
        """An operator drains a host (`python -m launcher drain`): it leaves at once (no grace to wait for a stop of
        the whole job); its agent is told, and the operator answered (Drain: accepted, or Refused: why)."""
        record = self.membership.hosts.get(request.host)
        if record is None:
            hosts = ", ".join(sorted(self.membership.hosts)) or "none"
            answer = Refused(reason=f"no host {request.host!r} in this job (its hosts: {hosts})")
        elif record.leaving:
            answer = Refused(reason=f"host {request.host!r} is leaving already")
        else:
            self.membership.leave(request.host, at=time.monotonic(), why="command")
            self.to_host(request.host, request)
            answer = request
        try:
            channel.send(answer)
        except ChannelClosed:
            pass
        channel.close()

    def _refusal(self, hello: Hello) -> str:
        """Why an agent is not admitted ('' if it is)."""
        if hello.version != str(PROTOCOL_VERSION):
            return (
                f"agent speaks protocol {hello.version}, the coordinator {PROTOCOL_VERSION}: install the same ckptless"
            )
        if hello.config_sha256 and hello.config_sha256 != self.config_sha256:
            return "the agent's run directory holds another config.yaml than this job's: start it with this job's --run-dir"
        if hello.name in self.membership.hosts:
            return f"a host named {hello.name!r} already joined: give each agent its own --host"
        if hello.name in self.membership.lost_hosts:
            return (
                f"host {hello.name!r} was declared lost and its ranks replaced: its workers' state is stale; restart "
                "its agent (under a new --host name) to join as a spare"
            )
        return ""

    def lose_host(self, host: str, detail: str, *, last_heard: float | None = None) -> None:
        """The host's agent is gone (its channel closed, or it fell silent): every process of the host with it.
        `last_heard`: its last sign of life (the coordinator's clock; None: its last message)."""
        if host in self.membership.lost_hosts:
            return
        if self.ending:
            if (left := self.membership.hosts.pop(host, None)) is not None:
                left.channel.close()
                self.events.emit("host_left", host=host)
            return
        self.events.emit("host_left" if self._handed_over(host) else "host_lost", host=host, detail=detail)
        if last_heard is None:
            record = self.membership.hosts.get(host)
            last_heard = record.last_heard if record is not None else time.monotonic()
        lost = self.membership.lose_host(host, detail, last_heard=last_heard)
        if lost is not None:
            lost.channel.close()

    def _handed_over(self, host: str) -> bool:
        """`host` was leaving and none of its workers trains (any more): it left (a drain), it was not lost."""
        record, generation = self.membership.hosts.get(host), self.membership.generation
        trains = any(self.membership.workers[n].host == host for n in generation.members)
        return record is not None and record.leaving and not trains

    def lose_silent_hosts(self, *, now: float, timeout_s: float) -> None:
        """Hosts whose agent sent nothing for `timeout_s` are lost (the coordinator's clock)."""
        hosts = self.membership.hosts
        for host in [h for h, record in hosts.items() if now - record.last_heard > timeout_s]:
            self.lose_host(host, f"silent for {now - hosts[host].last_heard:.1f} s")

    def to_host(self, host: str, message) -> None:
        if host not in self.membership.hosts:
            return
        try:
            self.membership.hosts[host].channel.send(message)
        except ChannelClosed:
            self.control.put(host, None)

    def to_every_host(self, message) -> None:
        for host in list(self.membership.hosts):
            self.to_host(host, message)

    def shut_down(self, *, timeout_s: float) -> None:
        """Every agent kills what is left on its host and exits; wait (bounded) for them to leave."""
        self.ending = True
        self.to_every_host(Shutdown(reason="job ended"))
        deadline = time.monotonic() + timeout_s
        while self.membership.hosts and time.monotonic() < deadline:
            self.wait_for_change(deadline - time.monotonic())
            self.drain()

    def stop_heartbeat(self) -> None:
        self._closed.set()
