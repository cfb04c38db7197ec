"""`cluster=hosts`: real hosts. The coordinator binds `cluster.coordinator_address` (its control channel and the
workers' c10d store listen there only); a node agent is started on each host by hand, or by any tool that places
processes, with the command this module prints; the run directory must be on storage every host sees. The job's
secret goes to a file in it that only its owner reads, before any agent starts."""

from __future__ import annotations

from pathlib import Path

from ckptless_core.channel import SECRET_FILE, new_secret, write_secret_file
from ckptless_core.coordinator_process import CoordinatorProcess
from launcher.clusters.workers import rank_commands
from launcher.errors import ConfigError
from launcher.torchrun import TorchrunJob
from recipes.schema import JobConfig
from recipes.train import worker_preload

NO_TORCHRUN = (
    "ft=checkpoint_restart runs torchrun on cluster=local or cluster=netns; on cluster=hosts start torchrun "
    "on each host yourself, or use ft=ckptless"
)


OPTIONS: tuple[str, ...] = ()
"""The `cluster.*` options only this kind reads (others refuse them when set)."""
COORDINATOR_TIMEOUT_S = 30.0
"""`ft.coordinator_timeout_s` by default: the launcher restarts a dead coordinator in place within a second."""


def check(job: JobConfig) -> None:
    if job.ft.mode == "checkpoint_restart":
        raise ConfigError(NO_TORCHRUN)


def warm_up(job: JobConfig) -> None:
    """Nothing: agents on real hosts join once the run directory (and its secret file) exists."""
    return None


def coordinator(job: JobConfig, *, run_dir: Path, warm: CoordinatorProcess | None) -> CoordinatorProcess:
    """The coordinator, listening; the command each host runs is printed."""
    secret = new_secret()
    write_secret_file(run_dir / SECRET_FILE, secret)
    coordinator = CoordinatorProcess(
        secret=secret, bind_address=job.cluster.coordinator_address, port=job.cluster.coordinator_port
    )
    _, port = coordinator.address
    print(
        f"waiting up to {job.cluster.start_timeout_s:.0f} s for {_num_agents(job)} node agent(s); on each host run:\n"
        f"  {agent_line(job, run_dir=run_dir, port=port)}",
        flush=True,
    )
    return coordinator


def torchrun(job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> TorchrunJob:
    raise ConfigError(NO_TORCHRUN)  # (`check` refused it already)


def agent_line(job: JobConfig, *, run_dir: Path, port: int | str) -> str:
    """The command that starts a host's node agent."""
    return (
        f"python -m ckptless_core.agent --coordinator {job.cluster.coordinator_address}:{port} --secret-file "
        f"{run_dir / SECRET_FILE} --run-dir {run_dir} --host <name> [--ifname <interface>] --preload "
        f"{' '.join(worker_preload(job))}"
    )


def worker_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    """In a run (not a dry run) the agent command is left to `coordinator`, which prints it with the port it got."""
    cluster = job.cluster
    joins = (
        f"# on each of {_num_agents(job)} host(s) ({cluster.spare_hosts} spare), its node agent joins the coordinator "
        f"at {cluster.coordinator_address}"
    )
    if job.dry_run:
        port = cluster.coordinator_port or "<port>"
        lines = [f"{joins}{'' if cluster.coordinator_port else ' (port chosen at start)'}:"]
        lines.append(agent_line(job, run_dir=run_dir, port=port))
    else:
        lines = [f"{joins} (the command is printed below once the coordinator listens)"]
    for i in range(cluster.num_hosts):
        lines.append(
            f"# training host {i} (training hosts are the first {cluster.num_hosts} --host names, sorted): its agent "
            "forks, with the c10d store at the coordinator's address"
        )
        lines += rank_commands(job, run_dir=run_dir, host=i, master_addr=cluster.coordinator_address)
    if cluster.spare_hosts:
        lines.append(f"# {cluster.spare_hosts} spare host(s): hot spares for the ranks of a lost host")
    return lines


def torchrun_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    raise ConfigError(NO_TORCHRUN)  # (`check` refused it already)


def _num_agents(job: JobConfig) -> int:
    return job.cluster.num_hosts + job.cluster.spare_hosts
