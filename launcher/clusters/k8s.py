"""`cluster=k8s`: the job as a JobSet (sigs.k8s.io/jobset), rendered into the run directory for `kubectl apply`.
(Being built: see issue 28.)"""

from __future__ import annotations

from pathlib import Path

from ckptless_core.coordinator_process import CoordinatorProcess
from launcher.errors import ConfigError
from launcher.torchrun import TorchrunJob
from recipes.schema import JobConfig

OPTIONS: tuple[str, ...] = ("ifname", "image", "namespace", "volume", "mount_path", "node_selector", "tolerations")
"""The `cluster.*` options only this kind reads (others refuse them when set)."""
COORDINATOR_TIMEOUT_S = 600.0
"""`ft.coordinator_timeout_s` by default: a coordinator pod on an unreachable node is evicted only after the
default 300 s toleration, then recreated elsewhere."""
NOT_YET = "cluster=k8s is being built (issue 28)"


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
