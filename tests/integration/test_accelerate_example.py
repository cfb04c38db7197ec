"""A user's own Hugging Face Accelerate loop (`examples/train_accelerate.py`) under the torchrun-like runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_accelerate.py"
STEPS = 40


def run_example(run_dir: Path, *runner_args: str) -> dict:
    """Run the example with 2 workers; returns its `result.json` (rank 0's final loss and parameter hash)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ckptless_core.run", "--nproc", "2", "--run-dir", str(run_dir), *runner_args]
        + [str(EXAMPLE), "--steps", str(STEPS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "result.json").read_text())


@pytest.fixture(scope="module")
def fault_free_result(tmp_path_factory) -> dict:
    return run_example(tmp_path_factory.mktemp("accelerate") / "clean", "--spares", "0")


def test_the_accelerate_example_survives_a_killed_worker_with_identical_parameters(fault_free_result, tmp_path):
    # `wait` holds the job for the spare if it is still starting (see test_runner.py).
    faulty = ("--spares", "1", "--on-no-spare", "wait", "--fault", f"kill_worker:1:{STEPS // 2}")
    assert run_example(tmp_path / "faulty", *faulty) == fault_free_result
    events = (tmp_path / "faulty" / "events" / "coordinator.jsonl").read_text()
    assert '"spare_promoted"' in events and '"fault_injected"' in events
    assert fault_free_result["loss"] < 2.5  # it learns: from ln(64) = 4.2 at the start
