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
    # The spare boots beside the workers; on a loaded machine it may not be ready by step 100, and the default
    # policy would then shrink to one rank (a whole-batch step rounds differently): `wait` holds for it instead.
    faulty = run_example(tmp_path / "faulty", "--spares", "1", "--on-no-spare", "wait", "--fault", "kill_worker:1:100")
    assert clean.returncode == 0 and faulty.returncode == 0, faulty.stdout + faulty.stderr
    expected = json.loads((tmp_path / "clean" / "result.json").read_text())
    result = json.loads((tmp_path / "faulty" / "result.json").read_text())
    assert result == expected
    events = (tmp_path / "faulty" / "events" / "coordinator.jsonl").read_text()
    assert '"spare_promoted"' in events and '"fault_injected"' in events


def test_the_runner_refuses_a_missing_script(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ckptless_core.run", str(tmp_path / "nope.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr


BUGGY_SCRIPT = """
import torch
from ckptless_core.grad_sync import FlatGradients
from ckptless_core.replica import Replica, WorkerState
from ckptless_core.transfer import materialize_optimizer_state, state_tensors

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
grads = FlatGradients(model.parameters())
replica = Replica.from_environ()
materialize_optimizer_state(optimizer)
replica.start(WorkerState(state_tensors(model, optimizer)))


def train_step(step):
    grads.zero()
    if step == 3 and replica.rank == 1:
        raise ValueError(f"batch of step {step} has no labels")  # a bug: every replay of the step raises it again
    model(torch.ones(2, 4)).sum().backward()
    replica.all_reduce(grads.buffer)
    with replica.critical_section():
        optimizer.step()


while replica.step < 10:
    replica.run_step(train_step)
replica.close()
"""


BUG_RUNS = 3
"""Run at once, loading the machine: under load, a worker's exit once reached the coordinator before the report
with its traceback (1 run in 8), and the job ended without it."""


def test_a_bug_in_the_step_ends_the_job_with_its_traceback_and_spends_no_spare(tmp_path):
    script = tmp_path / "buggy.py"
    script.write_text(BUGGY_SCRIPT)
    runs = [
        (
            tmp_path / f"run{i}",
            subprocess.Popen(
                [sys.executable, "-m", "ckptless_core.run", "--nproc", "2", "--spares", "1"]
                + ["--run-dir", str(tmp_path / f"run{i}"), str(script)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for i in range(BUG_RUNS)
    ]
    for run_dir, proc in runs:
        stdout, stderr = proc.communicate(timeout=300)
        _check_bug_run(run_dir, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))


def _check_bug_run(run_dir, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "Traceback" in proc.stderr and "ValueError: batch of step 3 has no labels" in proc.stderr
    assert "raised the same error again after a replay of step 4" in proc.stdout
    events = [json.loads(line) for line in (run_dir / "events" / "coordinator.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert "spare_promoted" not in kinds
    # Replayed once (one generation after the first), then given up on.
    assert [e["generation"] for e in events if e["event"] == "generation_started"] == [1, 2]
    assert any(e["event"] == "job_abandoned" and e["reason"] == "training_code_error" for e in events)
