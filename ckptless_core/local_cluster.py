"""Clusters on this machine, the same machinery as on many hosts: `LocalCluster` (the coordinator in this process
and one node agent beside it) and `NetnsCluster` (one agent per emulated host, see `netns`).

Agents are started at once, so their fork servers import the heavy modules while the launcher still checks its
input; every worker they fork later starts without paying for them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from ckptless_core.coordinator import Coordinator
from ckptless_core.netns import EmulatedHosts
from ckptless_core.protocol import new_secret


def agent_command(coordinator: tuple[str, int], *, host: str, ifname: str, preload: Sequence[str]) -> list[str]:
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
        "10",
        "--preload",
        *preload,
    ]


class LocalCluster(Coordinator):
    def __init__(self, *, preload: Sequence[str] = (), host: str = "local") -> None:
        super().__init__(secret=new_secret(), bind_address="127.0.0.1")
        self.agent = subprocess.Popen(
            agent_command(self.address, host=host, ifname="lo", preload=preload),
            env={**os.environ, "CKPTLESS_SECRET": self.secret.hex()},
        )

    def close(self) -> None:
        """Stop the job (the agent exits once its workers are gone); an agent never given a job is killed."""
        started = self.spec is not None
        super().close()
        try:
            self.agent.wait(timeout=10.0 if started else 0.0)
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.agent.wait()


class NetnsCluster(Coordinator):
    """Emulated hosts `host0..` (training hosts first, then spare hosts), each with its agent as PID 1. A host
    powered off is replaced by a fresh one, as a cluster's scheduler replaces a failed node: it joins as a spare
    host, so a long run can lose one host after another."""

    def __init__(self, *, num_hosts: int, preload: Sequence[str] = ()) -> None:
        self.emulated = EmulatedHosts(num_hosts)
        self.preload = tuple(preload)
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
            agent_command(self.address, host=host.name, ifname="eth0", preload=self.preload),
            env={**os.environ, "CKPTLESS_SECRET": self.secret.hex()},
        )

    def kill_host(self, host: str) -> None:
        self.emulated.kill(next(h for h in self.emulated.hosts if h.name == host))
        self._start_agent(self.emulated.add())

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.emulated.remove()
