"""`cluster=local`: one host, this machine. The coordinator and one node agent beside it (`LocalCluster`), or one
torchrun for the checkpoint-restart baseline; workers reach the c10d store on loopback."""

from __future__ import annotations

from pathlib import Path

from ckptless_core.coordinator_process import CoordinatorProcess
from ckptless_core.local_cluster import LocalCluster
from launcher.clusters.workers import rank_commands, torchrun_line
from launcher.errors import ConfigError
from launcher.torchrun import TorchrunJob, torchrun_command
from recipes.schema import JobConfig
from recipes.train import worker_preload

OPTIONS: tuple[str, ...] = ()
"""The `cluster.*` options only this kind reads (others refuse them when set)."""
COORDINATOR_TIMEOUT_S = 30.0
"""`ft.coordinator_timeout_s` by default: the launcher restarts a dead coordinator in place within a second."""


def check(job: JobConfig) -> None:
    if job.cluster.num_hosts != 1 or job.cluster.spare_hosts:
        raise ConfigError(
            "cluster=local is one host: for several, use cluster=netns (emulated hosts on this machine) or "
            "cluster=hosts (agents on real hosts)"
        )


def warm_up(job: JobConfig) -> CoordinatorProcess:
    return LocalCluster(
        preload=worker_preload(job), start_timeout_s=job.cluster.start_timeout_s, warm_forks=_workers_on_cpu(job)
    )


def _workers_on_cpu(job: JobConfig) -> bool:
    """Whether the workers train on CPU (gloo, or a torch without CUDA): then they can be forked from the launcher's
    own imports (`LocalCluster(warm_forks=True)`); CUDA workers come from a fresh interpreter."""
    import torch

    return job.cluster.backend == "gloo" or not torch.backends.cuda.is_built()


def coordinator(job: JobConfig, *, run_dir: Path, warm: CoordinatorProcess | None) -> CoordinatorProcess:
    return warm if warm is not None else warm_up(job)


def torchrun(job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> TorchrunJob:
    return TorchrunJob(job, run_dir=run_dir, threads_per_worker=threads_per_worker)


def worker_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    return rank_commands(job, run_dir=run_dir, host=0, master_addr="127.0.0.1")


def torchrun_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    return [torchrun_line(job, torchrun_command(job, run_dir=run_dir), run_dir=run_dir)]
