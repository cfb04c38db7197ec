"""Shared test setup: offline Hugging Face, a per-session token cache, and a helper to run the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher_zygote import LauncherZygote

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE)


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(scope="session")
def launch(token_cache, tmp_path_factory):
    """Run `python -m launcher *args` as a user would; returns the finished process (text output). Each launch is
    forked from a process that imported the launcher once (`tests/launcher_zygote.py`); `fresh_interpreter=True`
    starts `python -m launcher` itself."""
    zygote = LauncherZygote(_launch_env(token_cache), tmp_path_factory.mktemp("launches"))

    def run(
        *args: str, cwd: Path | None = None, timeout_s: float = 600, fresh_interpreter: bool = False
    ) -> subprocess.CompletedProcess:
        env = _launch_env(token_cache)  # (read at each launch: a test may have changed PATH or the like)
        if not fresh_interpreter:
            return zygote.run(list(args), cwd=cwd or Path.cwd(), env=env, timeout_s=timeout_s)
        return subprocess.run(
            [sys.executable, "-m", "launcher", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    yield run
    zygote.close()


TWO = ("cluster.nproc=2", "trainer.global_batch_size=16", "trainer.micro_batch_size=8")
THREE = ("cluster.nproc=3", "trainer.global_batch_size=24", "trainer.micro_batch_size=8")
FOUR = ("cluster.nproc=4", "trainer.global_batch_size=16", "trainer.micro_batch_size=4")
"""The data-parallel layouts of tiny_llama the recovery tests compare with a fault-free run (TWO is the recipe's)."""


@pytest.fixture(scope="session")
def fault_free_run(launch, tmp_path_factory):
    """`fault_free_run(steps, *layout)`: the run directory of tiny_llama trained `steps` steps in that layout without
    a failure, on this machine; one run per (steps, layout) for the whole session, shared by every module that
    compares a recovered run with it (where the ranks run, and spares, do not change what it computes)."""
    root = tmp_path_factory.mktemp("fault-free")
    runs: dict[tuple, Path] = {}

    def reference(steps: int, *layout: str) -> Path:
        key = (steps, *sorted(layout))
        if key not in runs:
            run_dir = root / f"reference-{len(runs)}"
            proc = launch("recipe=tiny_llama", f"trainer.max_steps={steps}", "trainer.print_every=1000",
                          "ft.spares=0", *layout, f"run.dir={run_dir}")  # fmt: skip
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            runs[key] = run_dir
        return runs[key]

    return reference


CHARTED_STEPS, CHARTED_FAULT_STEP = 10, 5


@pytest.fixture(scope="session")
def charted_recovery(launch, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """(process, run dir) of tiny_llama for CHARTED_STEPS steps with TensorBoard and W&B on, worker1 killed during
    step CHARTED_FAULT_STEP and replaced by the spare: shared by the loggers' and the trace's tests."""
    run_dir = tmp_path_factory.mktemp("charted") / "kill"
    proc = launch("recipe=tiny_llama", f"trainer.max_steps={CHARTED_STEPS}", "trainer.print_every=100",
                  "fault=kill_worker", "fault.rank=1", f"fault.step={CHARTED_FAULT_STEP}", "logging.tensorboard=true",
                  "logging.wandb=true", f"run.dir={run_dir}")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, run_dir


@pytest.fixture(scope="session")
def fault_free_hash(fault_free_run):
    """`fault_free_hash(steps, *layout)`: the `param_sha256` of `fault_free_run(steps, *layout)`."""
    return lambda steps, *layout: read_summary(fault_free_run(steps, *layout))["param_sha256"]


def _launch_env(token_cache: Path) -> dict[str, str]:
    return {**os.environ, **OFFLINE, "CKPTLESS_CACHE": str(token_cache), "PYTHONUNBUFFERED": "1"}


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
