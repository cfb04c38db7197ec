"""The run directory: where it is, refusing to clobber an earlier run, and what a run leaves in it."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from launcher.errors import ConfigError
from recipes.schema import JobConfig

RUN_OUTPUTS = (
    "config.yaml",
    "metrics.jsonl",
    "metrics.held.json",
    "summary.json",
    "hf",
    "hf.partial",
    "merged",
    "merged.partial",
    "goodput.json",
    "timeline.png",
    "events",
    "logs",
    "checkpoints",
    "coordinator",
    "control.secret",
    "agents",
    "launch.json",
    "slurm",
    "k8s",
    "tensorboard",
    "wandb",
)
"""What a run writes; `run.overwrite=true` removes exactly these, nothing else a user keeps there. The checkpoints
go too: a new run in the same directory must not restart from the previous run's (`resume=` another directory to
continue one), nor its coordinator resume the previous run's journal."""


def resolve_run_dir(job: JobConfig, *, recipe: str) -> Path:
    """`run.dir`, else a fresh `outputs/<recipe>/<timestamp>` under the current directory."""
    if job.run.dir is not None:
        return Path(job.run.dir).expanduser().absolute()
    base = Path("outputs") / recipe / time.strftime("%Y%m%d-%H%M%S")
    candidate, n = base, 1
    while candidate.exists():
        candidate, n = base.with_name(f"{base.name}-{n}"), n + 1
    return candidate.absolute()


def check_run_dir(path: Path, *, overwrite: bool, resume: str | None = None) -> None:
    """Bad input: an existing non-empty directory without `run.overwrite=true`, a file in the way, or overwriting
    the run that `resume=` continues from."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run.dir={path} exists and is not a directory; choose another run.dir")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ConfigError(
            f"run.dir={path} already holds files (an earlier run?); choose another run.dir, "
            "or pass run.overwrite=true to replace that run's outputs"
        )
    if resume is not None and Path(resume).expanduser().absolute() == path:
        raise ConfigError(
            f"resume={resume} is the run directory this run writes (and run.overwrite=true would delete its "
            "checkpoints); give the new run its own run.dir"
        )
    _check_writable(path)


def _check_writable(path: Path) -> None:
    """The run directory can be created and written: a directory is made and removed at once where it would go (in
    it, or in its nearest existing parent), which catches what permission bits do not (a read-only mount, /proc)."""
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ckptless-probe-", dir=parent))
    except OSError as error:
        raise ConfigError(
            f"run.dir={path} cannot be created or written ({error.strerror}: {parent}); choose a run.dir on "
            "writable storage"
        ) from None


def create_run_dir(path: Path) -> None:
    """Create the run directory, removing an earlier run's outputs (only reached with run.overwrite=true)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in RUN_OUTPUTS:
        target = path / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    (path / "events").mkdir()
    (path / "logs").mkdir()
