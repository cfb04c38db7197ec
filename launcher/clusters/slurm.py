"""`cluster=slurm`: the job submitted with sbatch.
(Being built: see issue 28.)"""

from __future__ import annotations

from pathlib import Path

from ckptless_core.coordinator_process import CoordinatorProcess
from launcher.errors import ConfigError
from launcher.torchrun import TorchrunJob
from recipes.schema import JobConfig

OPTIONS: tuple[str, ...] = (
    "ifname",
    "python",
    "partition",
    "account",
    "time",
    "time_warning_s",
    "sbatch_args",
    "srun_prefix",
    "queued_hosts",
    "detach",
    "shared_run_dir_ok",
)
"""The `cluster.*` options only this kind reads (others refuse them when set)."""
COORDINATOR_TIMEOUT_S = 900.0
"""`ft.coordinator_timeout_s` by default: a lost coordinator's job is requeued once Slurm marks its node down
(`SlurmdTimeout`, 300 s by default), then waits for a node."""
NOT_YET = "cluster=slurm is being built (issue 28)"


def check(job: JobConfig) -> None:
    raise ConfigError(NOT_YET)


def warm_up(job: JobConfig) -> None:
    return None


def coordinator(job: JobConfig, *, run_dir: Path, warm: CoordinatorProcess | None) -> CoordinatorProcess:
    raise ConfigError(NOT_YET)


def torchrun(job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> TorchrunJob:
    raise ConfigError(NOT_YET)


def worker_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    raise ConfigError(NOT_YET)


def torchrun_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    raise ConfigError(NOT_YET)
