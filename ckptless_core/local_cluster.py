"""A cluster on this machine, the same machinery as on many hosts: `LocalCluster`, the coordinator process and one
node agent beside it; and `agent_command`, the command that starts a node agent, for whatever starts agents on
other hosts (emulated ones, say).

The agent is started at once, so its fork server imports the heavy modules while the launcher still checks its
input; every worker it forks later starts without paying for them. With `warm_forks`, the workers come from a fork of
this process instead (`warm_forks`), which has imported them already: nothing is imported twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from ckptless_core.channel import new_secret
from ckptless_core.coordinator_process import CoordinatorProcess
from ckptless_core.warm_forks import can_fork_here, start_warm_fork_server


def agent_command(
    coordinator: tuple[str, int],
    *,
    host: str,
    ifname: str,
    preload: Sequence[str],
    connect_timeout_s: float,
    with_parent: bool = False,
    fork_server_fd: int | None = None,
) -> list[str]:
    """`connect_timeout_s`: the agent starts before the coordinator (their imports overlap) and waits this long for
    it; `with_parent`: the agent dies with the process that starts it (a local agent with its launcher);
    `fork_server_fd`: the agent's end of a warm fork server's socket (inherited), which forks its workers."""
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
        *(["--fork-server-fd", str(fork_server_fd)] if fork_server_fd is not None else []),
        "--preload",
        *preload,
    ]


class LocalCluster(CoordinatorProcess):
    def __init__(
        self,
        *,
        preload: Sequence[str] = (),
        host: str = "local",
        start_timeout_s: float = 300.0,
        warm_forks: bool = False,
    ) -> None:
        """`warm_forks`: fork the workers from this process's imports (`warm_forks`), where it runs one thread
        (else, and by default, the agent's own fork server imports `preload`). Only for workers on CPU: a process
        that touched the CUDA driver cannot hand it to a forked child."""
        self.fork_server: int | None = None
        agent_end = None
        if warm_forks and can_fork_here():  # (first: before this process opens the job's sockets)
            self.fork_server, agent_end = start_warm_fork_server(preload)
        super().__init__(secret=new_secret(), bind_address="127.0.0.1")
        command = agent_command(
            self.address,
            host=host,
            ifname="lo",
            preload=preload,
            connect_timeout_s=start_timeout_s,
            with_parent=True,
            fork_server_fd=None if agent_end is None else agent_end.fileno(),
        )
        self.agent = subprocess.Popen(
            command,
            env={**os.environ, "CKPTLESS_SECRET": self.secret.hex()},
            pass_fds=() if agent_end is None else (agent_end.fileno(),),
        )
        if agent_end is not None:
            agent_end.close()  # (the agent holds it now: the fork server ends when the agent does)

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
        if self.fork_server is not None:  # (it ends with the agent; its workers are gone with the agent too)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.fork_server, signal.SIGKILL)
            os.waitpid(self.fork_server, 0)
            self.fork_server = None
