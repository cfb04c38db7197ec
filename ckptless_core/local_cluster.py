"""Clusters on this machine, the same machinery as on many hosts: `LocalCluster` (the coordinator process and one
node agent beside it) and `NetnsCluster` (one agent per emulated host, see `netns`).

Agents are started at once, so their fork servers import the heavy modules while the launcher still checks its
input; every worker they fork later starts without paying for them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from ckptless_core.coordinator_process import CoordinatorProcess
from ckptless_core.faults import FaultEvent
from ckptless_core.job import JobOutcome
from ckptless_core.netns import EmulatedHosts
from ckptless_core.protocol import new_secret


def agent_command(
    coordinator: tuple[str, int],
    *,
    host: str,
    ifname: str,
    preload: Sequence[str],
    connect_timeout_s: float,
    with_parent: bool = False,
) -> list[str]:
    """`connect_timeout_s`: the agent starts before the coordinator (their imports overlap) and waits this long for
    it; `with_parent`: the agent dies with the process that starts it (a local agent with its launcher)."""
    return [
        sys.executable,
        "-m",
        "ckptless_core.agent",
        "--coordinator",
        f"{coordinator[0]}:{coordinator[1]}",
        "--host",
        host,
        "--ifname",
        ifname,
        "--connect-timeout-s",
        str(connect_timeout_s),
        *(["--exit-with-parent"] if with_parent else []),
        "--preload",
        *preload,
    ]


class LocalCluster(CoordinatorProcess):
    def __init__(self, *, preload: Sequence[str] = (), host: str = "local", start_timeout_s: float = 300.0) -> None:
        super().__init__(secret=new_secret(), bind_address="127.0.0.1")
        command = agent_command(
            self.address, host=host, ifname="lo", preload=preload, connect_timeout_s=start_timeout_s, with_parent=True
        )
        self.agent = subprocess.Popen(
            command,
            env={**os.environ, "CKPTLESS_SECRET": self.secret.hex()},
        )

    def close(self) -> None:
        """Stop the job (the agent exits once its workers are gone); an agent never given a job is killed."""
        started = self.process is not None
        if not started:  # first: it would report the coordinator's closed connection as a failed handshake
            self.agent.kill()
        super().close()
        try:
            self.agent.wait(timeout=10.0 if started else 0.0)
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.agent.wait()


class NetnsCluster(CoordinatorProcess):
    """Emulated hosts `host0..` (training hosts first, then spare hosts), each with its agent as PID 1. A host
    whose agent failed is replaced by a fresh one, as a cluster's scheduler replaces a failed node: it joins as a
    spare host, so a long run can lose one host after another."""

    def __init__(self, *, num_hosts: int, preload: Sequence[str] = (), start_timeout_s: float = 300.0) -> None:
        self.emulated = EmulatedHosts(num_hosts)
        self.preload = tuple(preload)
        self.start_timeout_s = start_timeout_s
        self._replaced: set[str] = set()
        try:
            super().__init__(secret=new_secret(), bind_address=self.emulated.gateway)
            for host in self.emulated.hosts:
                self._start_agent(host)
        except BaseException:
            self.emulated.remove()
            raise

    def _start_agent(self, host) -> None:
        self.emulated.start(
            host,
            agent_command(
                self.address,
                host=host.name,
                ifname="eth0",
                preload=self.preload,
                connect_timeout_s=self.start_timeout_s,
            ),
            env={**os.environ, "CKPTLESS_SECRET": self.secret.hex()},
        )

    def strike_host(self, event: FaultEvent, host: str) -> None:
        emulated = next(h for h in self.emulated.hosts if h.name == host)
        if event.kind == "partition":
            self.emulated.partition(emulated, event.duration_s)
        else:
            self.emulated.kill(emulated)

    def poll(self) -> JobOutcome | None:
        outcome = super().poll()
        if outcome is None:
            self._replace_failed_hosts()
        return outcome

    def _replace_failed_hosts(self) -> None:
        """A host whose agent is gone with an error (powered off, or refused after a partition: it fenced itself
        and the job went on without it) is replaced by a fresh host."""
        for host in list(self.emulated.hosts):
            code = host.process.poll() if host.process is not None else None
            if code not in (None, 0) and host.name not in self._replaced:
                self._replaced.add(host.name)
                self._start_agent(self.emulated.add())

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.emulated.remove()
