"""Cluster kinds: where a job's workers run. One module per kind (`local`, `netns`, `hosts`), each with the same
few functions (`ClusterKind`), looked up by `cluster.kind` (`cluster_kind`). The job a kind starts is followed and
stopped the same way on every kind (`Runner`): that part is `launcher.run`'s, as is the choice between the ckptless
coordinator and the torchrun baseline (`ft=checkpoint_restart`).

A new kind is a module here with these functions, and one entry in `KINDS`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ckptless_core.coordinator_process import CoordinatorProcess
from ckptless_core.job import JobOutcome
from launcher.clusters import hosts, k8s, local, netns, slurm
from launcher.errors import ConfigError
from launcher.torchrun import TorchrunJob
from recipes.schema import JobConfig


class Runner(Protocol):
    """A started job, on any kind: the ckptless coordinator (`CoordinatorProcess`) or torchrun (`TorchrunJob`)."""

    def poll(self) -> JobOutcome | None:
        """None while the job runs; then how it ended."""

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep until something may have changed, at most `timeout_s`."""

    def request_stop(self) -> None:
        """Stop at the next step boundary (Ctrl-C, SIGTERM)."""

    def close(self) -> None:
        """Stop whatever still runs and release what the kind made (agents, emulated hosts)."""

    def exit_codes(self) -> dict[str, int | None]:
        """Exit code of each process the summary names."""


class ClusterKind(Protocol):
    """What each kind's module provides."""

    OPTIONS: tuple[str, ...]
    """The `cluster.*` options only this kind reads: set with another kind, they are refused."""
    COORDINATOR_TIMEOUT_S: float
    """`ft.coordinator_timeout_s` when not set: longer than what brings a lost coordinator back on this kind."""

    def check(self, job: JobConfig) -> None:
        """Refuse (`ConfigError`) a job this kind cannot run, before anything starts."""

    def warm_up(self, job: JobConfig) -> CoordinatorProcess | None:
        """Start the coordinator and the agents this machine starts, while the launcher still checks its input:
        their fork servers import torch and the model's code meanwhile. None: nothing to start early."""

    def coordinator(self, job: JobConfig, *, run_dir: Path, warm: CoordinatorProcess | None) -> CoordinatorProcess:
        """The ckptless coordinator (the one `warm_up` started, if any) that the job's node agents join."""

    def torchrun(self, job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> TorchrunJob:
        """The checkpoint-restart baseline placed on this kind (not started)."""

    def worker_lines(self, job: JobConfig, *, run_dir: Path) -> list[str]:
        """For the dry run: where the node agents run and what each worker they fork runs, as shell lines."""

    def torchrun_lines(self, job: JobConfig, *, run_dir: Path) -> list[str]:
        """For the dry run: the torchrun command of each host, as shell lines."""


KINDS: dict[str, ClusterKind] = {"local": local, "netns": netns, "hosts": hosts, "slurm": slurm, "k8s": k8s}


SCHEDULED = ("slurm", "k8s")
"""Kinds whose scheduler places the job (`submit`): the job serves itself there (`launcher.coordinate`), this
launcher only submits it (and follows it, where the scheduler lets it)."""


def is_scheduled(name: str) -> bool:
    return name in SCHEDULED


def cluster_kind(name: str) -> ClusterKind:
    """The module of `cluster.kind`; an unknown kind is refused with the list of known ones."""
    if name not in KINDS:
        raise ConfigError(f"cluster.kind={name!r}: choose one of {list(KINDS)} (cluster=<kind>)")
    return KINDS[name]
