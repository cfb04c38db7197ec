"""Shared test setup: offline Hugging Face, a per-session token cache, and a helper to run the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
os.environ.update(OFFLINE)


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(scope="session")
def launch(token_cache):
    """Run `python -m launcher *args` as a user would; returns the finished process (text output)."""

    def run(*args: str, cwd: Path | None = None, timeout_s: float = 600) -> subprocess.CompletedProcess:
        env = {**os.environ, **OFFLINE, "CKPTLESS_CACHE": str(token_cache), "PYTHONUNBUFFERED": "1"}
        return subprocess.run(
            [sys.executable, "-m", "launcher", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    return run


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
