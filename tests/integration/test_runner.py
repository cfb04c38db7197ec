"""A user's own PyTorch script (no Hugging Face, no Hydra) under the torchrun-like runner of ckptless_core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"


def run_example(run_dir: Path, *runner_args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptless_core.run",
            "--nproc",
            "2",
            "--run-dir",
            str(run_dir),
            *runner_args,
            str(EXAMPLE),
            "--steps",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_the_example_survives_a_killed_worker_with_identical_parameters(tmp_path):
    clean = run_example(tmp_path / "clean", "--spares", "0")
    faulty = run_example(tmp_path / "faulty", "--spares", "1", "--fault", "kill_worker:1:100")
    assert clean.returncode == 0 and faulty.returncode == 0, faulty.stdout + faulty.stderr
    expected = json.loads((tmp_path / "clean" / "result.json").read_text())
    result = json.loads((tmp_path / "faulty" / "result.json").read_text())
    assert result == expected
    events = (tmp_path / "faulty" / "events" / "supervisor.jsonl").read_text()
    assert '"spare_promoted"' in events and '"fault_injected"' in events


def test_the_runner_refuses_a_missing_script(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ckptless_core.run", str(tmp_path / "nope.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr
