"""Training runs through `python -m launcher`, read back from what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ckptless_core.events import read_events
from ckptless_core.state_hash import param_sha256
from tests.conftest import TWO, read_metrics, read_summary

SHORT_STEPS = 24
SHORT = (f"trainer.max_steps={SHORT_STEPS}", "trainer.print_every=5")
"""As long as the fault-free runs other modules share (`fault_free_run`): a second run of the same seed."""


@pytest.fixture(scope="module")
def tiny_llama_run(launch, tmp_path_factory):
    """The recipe as a user runs it: its default steps, two workers, `python -m launcher` in an interpreter of its
    own (the other runs are forked from one that imported the launcher already)."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny_llama"
    return launch("recipe=tiny_llama", f"run.dir={run_dir}", fresh_interpreter=True), run_dir


@pytest.fixture(scope="module")
def short_two_workers(launch, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "short2"
    return launch("recipe=tiny_llama", *SHORT, f"run.dir={run_dir}"), run_dir


def test_tiny_llama_trains_and_the_loss_halves(tiny_llama_run):
    proc, run_dir = tiny_llama_run
    assert proc.returncode == 0, proc.stderr + proc.stdout
    summary = read_summary(run_dir)
    metrics = read_metrics(run_dir)
    assert summary["status"] == "completed"
    assert summary["steps"] == 100 and summary["world_size"] == 2
    assert [m["step"] for m in metrics] == list(range(1, 101))
    assert metrics[-1]["loss"] < metrics[0]["loss"] / 2
    assert summary["final_loss"] == pytest.approx(metrics[-1]["loss"])
    assert "step 100/100 | loss" in proc.stdout and "tok/s" in proc.stdout
    assert {"torch", "transformers", "threads_per_worker"} <= set(summary["provenance"])


def test_run_directory_holds_what_users_read(tiny_llama_run):
    _, run_dir = tiny_llama_run
    assert (run_dir / "config.yaml").is_file()
    # The coordinator, two workers and the hot spare (ft.spares=1 by default).
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert logs == ["coordinator.log", "worker0.log", "worker1.log", "worker2.log"]
    for path in (run_dir / "events").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            assert {"t", "event", "worker", "rank"} <= set(event)
    # The final weights are a Hugging Face folder; anyone can recompute the fingerprint from what it loads.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf", local_files_only=True)
    assert param_sha256(model.state_dict()) == read_summary(run_dir)["param_sha256"]
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())


def test_same_seed_twice_gives_the_same_parameters(short_two_workers, fault_free_hash):
    """Two runs of the same seed: this module's, and the fault-free run of the same layout the session shares (its
    spare and printing differ, which change nothing computed)."""
    first, first_dir = short_two_workers
    assert first.returncode == 0, first.stderr
    assert read_summary(first_dir)["param_sha256"] == fault_free_hash(SHORT_STEPS, *TWO)


def test_one_worker_and_two_workers_agree_on_the_loss(launch, short_two_workers, tmp_path):
    _, two_dir = short_two_workers
    one = launch("recipe=tiny_llama", *SHORT, "cluster.nproc=1", f"run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr
    assert read_summary(tmp_path / "one")["world_size"] == 1
    one_losses = [m["loss"] for m in read_metrics(tmp_path / "one")]
    two_losses = [m["loss"] for m in read_metrics(two_dir)]
    assert one_losses == pytest.approx(two_losses, rel=1e-3)


def test_tiny_gpt_oss_trains(launch, tmp_path):
    proc = launch("recipe=tiny_gpt_oss", f"run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    metrics = read_metrics(tmp_path)
    assert read_summary(tmp_path)["status"] == "completed"
    assert metrics[-1]["loss"] < metrics[0]["loss"] / 2


def test_bf16_autocast_trains(launch, tmp_path):
    proc = launch(
        "recipe=tiny_llama", "trainer.precision=bf16", "trainer.max_steps=5", "cluster.nproc=1", f"run.dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 5 and metrics[-1]["loss"] < metrics[0]["loss"]


def test_the_worker_entry_point_also_runs_under_torchrun(short_two_workers, tmp_path, token_cache):
    """Plain data parallelism without the ckptless supervisor: the same worker, the same bits."""
    _, reference_dir = short_two_workers
    (tmp_path / "config.yaml").write_text((reference_dir / "config.yaml").read_text())
    env = {**os.environ, "CKPTLESS_RUN_DIR": str(tmp_path), "CKPTLESS_CACHE": str(token_cache)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "recipes.train",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ends = [e for e in read_events(tmp_path / "events") if e["event"] == "train_end"]
    assert {e["param_sha256"] for e in ends} == {read_summary(reference_dir)["param_sha256"]}
