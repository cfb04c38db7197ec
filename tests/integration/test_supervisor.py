"""The supervisor under real failures: a worker killed, the launcher killed, the launcher interrupted."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ckptless_core.events import read_events, read_jsonl
from tests.conftest import OFFLINE, read_summary

LONG_RUN = ("recipe=tiny_llama", "trainer.max_steps=2000")


def start_launcher(run_dir: Path, token_cache: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, **OFFLINE, "CKPTLESS_CACHE": str(token_cache)}
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", *LONG_RUN, *overrides, f"run.dir={run_dir}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(predicate, *, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def training_workers(run_dir: Path) -> dict[str, int]:
    """Worker name -> pid of every worker and spare, once worker1 has committed a step."""
    events = list(read_jsonl(run_dir / "events" / "coordinator.jsonl"))
    pids = {e["worker_name"]: e["pid"] for e in events if e["event"] == "worker_started"}
    steps = list(read_jsonl(run_dir / "events" / "worker1.jsonl"))
    trained = any(e["event"] == "step_committed" for e in steps)
    return pids if trained else {}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_without_fault_tolerance_a_killed_worker_fails_the_job_with_a_clear_report(tmp_path, token_cache):
    launcher = start_launcher(tmp_path / "run", token_cache, "ft=none")
    try:
        pids = wait_for(lambda: training_workers(tmp_path / "run"), timeout_s=120, what="training to start")
        os.kill(pids["worker1"], signal.SIGKILL)
        output, _ = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 3, output
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "failed"
    assert "worker1" in summary["message"] and "SIGKILL" in summary["message"]
    assert "FAILED" in output
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), timeout_s=15, what="workers to stop")


def test_workers_never_outlive_a_killed_launcher(tmp_path, token_cache):
    launcher = start_launcher(tmp_path / "run", token_cache)
    try:
        pids = wait_for(lambda: training_workers(tmp_path / "run"), timeout_s=120, what="training to start")
        launcher.kill()
        launcher.wait(timeout=30)
        wait_for(lambda: not any(alive(pid) for pid in pids.values()), timeout_s=30, what="orphaned workers to die")
    finally:
        launcher.kill()


def test_ctrl_c_stops_the_job_and_its_workers(tmp_path, token_cache):
    launcher = start_launcher(tmp_path / "run", token_cache)
    try:
        pids = wait_for(lambda: training_workers(tmp_path / "run"), timeout_s=120, what="training to start")
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, output
    assert read_summary(tmp_path / "run")["status"] == "stopped"
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), timeout_s=15, what="workers to stop")


def test_preemption_stops_cleanly_with_a_final_checkpoint_and_the_run_resumes(tmp_path, token_cache, launch):
    launcher = start_launcher(tmp_path / "run", token_cache, "ft.checkpoint_every=1000")
    try:
        wait_for(lambda: training_workers(tmp_path / "run"), timeout_s=120, what="training to start")
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, output
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "stopped"
    stopped_at = summary["steps"]
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints] == [f"step_{stopped_at:08d}"]
    # A newer checkpoint that is damaged (here: its data cut short) is skipped, with an event, for the newest usable one.
    damaged = shutil.copytree(checkpoints[0], checkpoints[0].with_name(f"step_{stopped_at + 1:08d}"))
    for data in damaged.glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:1000])

    resumed = launch(
        "recipe=tiny_llama",
        f"trainer.max_steps={stopped_at + 5}",
        f"resume={tmp_path / 'run'}",
        f"run.dir={tmp_path / 'resumed'}",
    )
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(stopped_at + 1, stopped_at + 6))
    skipped = [e for e in read_events(tmp_path / "resumed" / "events") if e["event"] == "checkpoint_skipped"]
    assert skipped and {e["path"] for e in skipped} == {str(damaged)}


def test_agents_without_a_coordinator_for_its_timeout_stop_their_workers_at_a_step_boundary(tmp_path, token_cache):
    """An agent started by hand (`cluster=hosts`) outlives the launcher and its coordinator, both SIGKILLed: its
    workers train on while it tries to reconnect; after `ft.coordinator_timeout_s` they stop together at a step
    boundary, writing the final checkpoint, and the agent exits with code 3 saying why."""
    run_dir = tmp_path / "run"
    overrides = (
        "cluster=hosts",
        "cluster.num_hosts=1",
        "cluster.nproc_per_host=2",
        "ft.spares=0",
        "ft.checkpoint_every=1000",
    )
    launcher = start_launcher(run_dir, token_cache, *overrides, "ft.coordinator_timeout_s=3")
    agent = None
    try:
        lines = [launcher.stdout.readline()]
        while "--coordinator" not in lines[-1]:
            lines.append(launcher.stdout.readline())
            assert lines[-1], "".join(lines)
        coordinator = re.search(r"--coordinator (\S+)", lines[-1]).group(1)
        command = [sys.executable, "-m", "ckptless_core.agent", "--coordinator", coordinator, "--host", "node0"]
        command += ["--secret-file", str(run_dir / "control.secret"), "--run-dir", str(run_dir)]
        env = {**os.environ, **OFFLINE, "CKPTLESS_CACHE": str(token_cache)}
        agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        pids = wait_for(lambda: training_workers(run_dir), timeout_s=120, what="training to start")
        launcher.kill()
        assert agent.wait(timeout=60) == 3
        assert "no coordinator for 3 s (ft.coordinator_timeout_s)" in agent.stderr.read()
    finally:
        launcher.kill()
        if agent is not None:
            agent.kill()
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), timeout_s=15, what="workers to stop")
    stopped = [e for e in read_events(run_dir / "events") if e["event"] == "stopped"]
    assert len(stopped) == 2 and len({e["step"] for e in stopped}) == 1  # together, at one step boundary
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints] == [f"step_{stopped[0]['step']:08d}"]
