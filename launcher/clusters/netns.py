"""`cluster=netns`: emulated hosts on this machine (`ckptless_core.netns`; needs root), `host0..` (training hosts,
then spare hosts), each its own network, PID and UTS namespace on a bridge of its own. The coordinator binds the
bridge; each host's node agent (PID 1 of the host) forks that host's workers (`NetnsCluster`).

Under `ft=checkpoint_restart` it is torchrun as it runs on a real cluster (`EmulatedTorchrun`): one torchrun per
host, meeting in a c10d rendezvous whose store the launcher holds on the bridge. A lost host is replaced by a fresh
one, as a scheduler replaces a failed node. The survivors learn of the loss when the replacement's torchrun waits in
the rendezvous once the lost one's keep-alive expired (`launcher.torchrun.KEEP_ALIVE_S`), or when their collective
times out (`cluster.collective_timeout_s`), whichever comes first; then every host restarts its workers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ckptless_core.channel import new_secret
from ckptless_core.coordinator_process import CoordinatorProcess
from ckptless_core.faults import FaultEvent
from ckptless_core.job import JobOutcome
from ckptless_core.local_cluster import agent_command
from ckptless_core.netns import EmulatedHost, EmulatedHosts, NetnsUnavailable, gateway_address, host_address
from ckptless_core.netns import check_available as check_netns_available
from launcher.clusters.workers import rank_commands, torchrun_line
from launcher.errors import ConfigError
from launcher.torchrun import TorchrunJob, torchrun_command
from recipes.schema import JobConfig
from recipes.train import worker_preload

IFNAME = "eth0"
"""Each emulated host's link to the bridge: its workers' collectives go over it."""
SUBNET = "10.213.K"
"""The dry run's name for the hosts' subnet: `ckptless_core.netns` picks a free 10.213.K.0/24 at start (its
`gateway_address` holds the coordinator, the c10d store and torchrun's rendezvous; `host_address` each host's)."""


OPTIONS: tuple[str, ...] = ()
"""The `cluster.*` options only this kind reads (others refuse them when set)."""
COORDINATOR_TIMEOUT_S = 30.0
"""`ft.coordinator_timeout_s` by default: the launcher restarts a dead coordinator in place within a second."""


def check(job: JobConfig) -> None:
    try:
        check_netns_available()
    except NetnsUnavailable as error:
        raise ConfigError(str(error)) from None


def warm_up(job: JobConfig) -> CoordinatorProcess:
    return NetnsCluster(
        num_hosts=job.cluster.num_hosts + job.cluster.spare_hosts,
        preload=worker_preload(job),
        start_timeout_s=job.cluster.start_timeout_s,
    )


def coordinator(job: JobConfig, *, run_dir: Path, warm: CoordinatorProcess | None) -> CoordinatorProcess:
    return warm if warm is not None else warm_up(job)


def torchrun(job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> TorchrunJob:
    return EmulatedTorchrun(job, run_dir=run_dir, threads_per_worker=threads_per_worker)


def worker_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    cluster = job.cluster
    total = cluster.num_hosts + cluster.spare_hosts
    lines = [
        f"# {total} emulated host(s) on this machine, host0..host{total - 1} ({cluster.spare_hosts} spare), each "
        f"its own network namespace, {IFNAME} {SUBNET}.(10 + i) on a bridge (K chosen at start); each host's node "
        f"agent joins the coordinator at {gateway_address(SUBNET)}, which holds the workers' c10d store, and forks:"
    ]
    for i in range(cluster.num_hosts):
        lines.append(f"# host{i} ({host_address(SUBNET, i)})")
        lines += rank_commands(
            job,
            run_dir=run_dir,
            host=i,
            master_addr=gateway_address(SUBNET),
            env={"GLOO_SOCKET_IFNAME": IFNAME, "NCCL_SOCKET_IFNAME": IFNAME},
        )
    for i in range(cluster.num_hosts, total):
        lines.append(
            f"# host{i} ({host_address(SUBNET, i)}): a spare host, its workers hot spares for the ranks of a lost host"
        )
    return lines


def torchrun_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    lines = [
        f"# {job.cluster.num_hosts} emulated host(s) on this machine, each its own network namespace, {IFNAME} "
        f"{SUBNET}.(10 + i) on a bridge (K chosen at start): one torchrun each, meeting in the c10d rendezvous the "
        f"launcher holds at {gateway_address(SUBNET)} (port chosen at start); a lost host's replacement runs its command"
    ]
    for i in range(job.cluster.num_hosts):
        command = torchrun_command(
            job,
            run_dir=run_dir,
            host=(f"host{i}", host_address(SUBNET, i)),
            rendezvous=f"{gateway_address(SUBNET)}:$RDZV_PORT",
        )
        lines.append(f"# host{i} ({host_address(SUBNET, i)})")
        lines.append(torchrun_line(job, command, run_dir=run_dir, env=EmulatedTorchrun.host_env))
    return lines


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
                ifname=IFNAME,
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


class EmulatedTorchrun(TorchrunJob):
    """The baseline on emulated hosts: one torchrun per host (in the host's network only, so the launcher reads and
    signals its workers' pids), the rendezvous store on the bridge; `fault=kill_host` powers a host off and starts a
    fresh one in its place."""

    host_env = {
        "GLOO_SOCKET_IFNAME": IFNAME,
        "NCCL_SOCKET_IFNAME": IFNAME,
        # torch's opt-out of sharing the rendezvous store with the workers: with it shared, a host keeps the
        # workers' store address of its first round, so a host that joins a later round (a replacement)
        # waits forever for one that is never published.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }

    def __init__(self, job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> None:
        super().__init__(job, run_dir=run_dir, threads_per_worker=threads_per_worker)
        self.emulated: EmulatedHosts | None = None
        self.rendezvous: dist.TCPStore | None = None

    def start(self) -> None:
        self.emulated = EmulatedHosts(self.job.cluster.num_hosts)
        self.rendezvous = dist.TCPStore(
            self.emulated.gateway,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.job.cluster.start_timeout_s),
        )
        self.events.emit("rendezvous_started", address=self.emulated.gateway, port=self.rendezvous.port)
        for host in self.emulated.hosts:
            self._start_host(host)

    def _start_host(self, host: EmulatedHost) -> None:
        rendezvous = f"{self.emulated.gateway}:{self.rendezvous.port}"
        command = torchrun_command(
            self.job, run_dir=self.run_dir, host=(host.name, host.address), rendezvous=rendezvous
        )
        with (self.run_dir / "logs" / f"torchrun-{host.name}.log").open("ab") as log:
            self.emulated.start(host, command, env=self.env | self.host_env, pid_namespace=False, output=log)
        self._started(host.name, host.process, command)

    def exit_codes(self) -> dict[str, int | None]:
        return {f"torchrun@{name}": process.returncode for name, process in self.torchruns.items()}

    def _host_of(self, pid: int) -> EmulatedHost | None:
        return self.emulated.host_of(pid) if self.emulated is not None else None

    def _power_off(self, host: EmulatedHost) -> None:
        """`fault=kill_host`: the host is gone with its torchrun and workers; a fresh host takes its place at once
        and joins the next rendezvous round, as a cluster's scheduler replaces a failed node."""
        self.emulated.kill(host)
        del self.torchruns[host.name]
        self._start_host(self.emulated.add())

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Stop every torchrun and its workers, then remove the emulated hosts."""
        try:
            super().close(timeout_s=timeout_s)
        finally:
            if self.emulated is not None:
                self.emulated.remove()
