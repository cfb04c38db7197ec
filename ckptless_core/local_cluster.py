"""A cluster on this machine, the same machinery as on many hosts: `LocalCluster`, the coordinator process and one
node agent beside it; and `agent_command`, the command that starts a node agent, for whatever starts agents on
other hosts (emulated ones, say).

The agent is started at once, so its fork server imports the heavy modules while the launcher still checks its
input; every worker it forks later starts without paying for them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from ckptless_core.channel import new_secret
from ckptless_core.coordinator_process import CoordinatorProcess


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
