"""The shell lines a dry run prints about workers, shared by the cluster kinds: the command each worker runs with the
torchrun-compatible environment its node agent gives it (the agent forks the same entry, with the same environment,
from a pre-imported parent), and a torchrun command line for the checkpoint-restart baseline."""

from __future__ import annotations

import shlex
from pathlib import Path

from launcher.plan import threads_per_worker
from recipes.schema import JobConfig

WORKER_LINES_SHOWN = 8
"""Of a host's worker commands a plan shows this many, then how many more, then the last."""


def rank_commands(
    job: JobConfig,
    *,
    run_dir: Path,
    host: int,
    master_addr: str,
    env: dict[str, str] | None = None,
) -> list[str]:
    """The workers of training host `host` (ranks `host` x `nproc_per_host` on; the coordinator gives each host
    consecutive ranks), each with its rank on the host as LOCAL_RANK, reaching the c10d store at `master_addr`. The
    store's port is chosen at start: by hand, export MASTER_PORT first. `env`: more variables the agent sets. A host
    of many workers shows the first WORKER_LINES_SHOWN, how many more, and the last."""
    per_host = job.cluster.nproc_per_host
    quoted_dir = shlex.quote(str(run_dir))
    config = shlex.quote(str(run_dir / "config.yaml"))
    extra = "".join(f"{key}={value} " for key, value in (env or {}).items())
    lines = [
        f"RANK={rank} LOCAL_RANK={rank % per_host} WORLD_SIZE={job.cluster.nproc} MASTER_ADDR={master_addr} "
        f"MASTER_PORT=$MASTER_PORT {extra}CKPTLESS_RUN_DIR={quoted_dir} OMP_NUM_THREADS={threads_per_worker(job)} "
        f"python -m recipes.train {config}"
        for rank in range(host * per_host, (host + 1) * per_host)
    ]
    if len(lines) <= WORKER_LINES_SHOWN + 2:
        return lines
    hidden = len(lines) - WORKER_LINES_SHOWN - 1
    return [*lines[:WORKER_LINES_SHOWN], f"... {hidden} more workers like these ...", lines[-1]]


def torchrun_line(job: JobConfig, command: list[str], *, run_dir: Path, env: dict[str, str] | None = None) -> str:
    """A torchrun command (`launcher.torchrun.torchrun_command`) as a shell line, with the environment the launcher
    gives it; words holding a `$VARIABLE` are left for the shell to expand."""
    words = ["python", *command[1:]]
    line = " ".join(word if "$" in word else shlex.quote(word) for word in words)
    variables = {
        "CKPTLESS_RUN_DIR": shlex.quote(str(run_dir)),
        "OMP_NUM_THREADS": threads_per_worker(job),
        **(env or {}),
    }
    return " ".join(f"{key}={value}" for key, value in variables.items()) + " " + line
