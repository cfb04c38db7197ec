"""Signals reaching the workers of a real run: stray SIGUSR1/SIGUSR2 (Slurm's `--signal`, an operator's `kill`)
change nothing, and an injected native crash (`fault=segfault`) is recovered like a killed worker. Final parameters
are compared bitwise with a run that had neither."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ckptless_core.events import read_events
from tests.conftest import OFFLINE, TWO, read_summary

STEPS = 24
FAULT_STEP = 10
JOB = ("recipe=tiny_llama", f"trainer.max_steps={STEPS}", "trainer.print_every=100", *TWO)


@pytest.fixture(scope="module")
def fault_free(fault_free_hash) -> str:
    return fault_free_hash(STEPS, *TWO)


def wait_for(predicate, *, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_stray_sigusr1_and_sigusr2_reach_workers_and_spare_and_change_nothing(token_cache, tmp_path, fault_free):
    run_dir = tmp_path / "run"
    env = {**os.environ, **OFFLINE, "CKPTLESS_CACHE": str(token_cache), "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "launcher", *JOB, "ft.spares=1", f"run.dir={run_dir}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def training_processes() -> dict[str, int]:
            """Worker name -> pid of both workers and the spare, once a step is committed."""
            events = read_events(run_dir / "events")
            pids = {e["worker"]: e["pid"] for e in events if e["event"] == "worker_start"}
            committed = any(e["event"] == "step_committed" for e in events)
            return pids if committed and len(pids) == 3 else {}

        pids = wait_for(training_processes, timeout_s=300, what="two workers and a spare, and a committed step")
        sent_at = time.time()
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR1)
            os.kill(pid, signal.SIGUSR2)
        code = launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert code == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["param_sha256"] == fault_free
    assert summary["failures"] == [] and summary["errors"] == []
    events = read_events(run_dir / "events")
    # The signals came while training went on: steps were committed after them, by the same processes.
    assert any(e["event"] == "step_committed" and e["t"] > sent_at for e in events)
    assert {e["worker"]: e["pid"] for e in events if e["event"] == "worker_start"} == pids


def test_a_segfault_is_recovered_like_a_killed_worker_with_the_same_bits(launch, tmp_path, fault_free):
    run_dir = tmp_path / "run"
    proc = launch(
        *JOB, "ft.spares=1", "fault=segfault", "fault.rank=1", f"fault.step={FAULT_STEP}", f"run.dir={run_dir}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["param_sha256"] == fault_free
    (failure,) = summary["failures"]
    assert (failure["worker"], failure["rank"], failure["detail"]) == ("worker1", 1, "killed by SIGSEGV")
    # The crash comes at the next forward after the signal: in the step in progress, or the next if that one's
    # forward was already done.
    assert failure["step"] in (FAULT_STEP, FAULT_STEP + 1)
    assert summary["exit_codes"]["worker1"] == -signal.SIGSEGV
    events = read_events(run_dir / "events")
    (injected,) = [e for e in events if e["event"] == "fault_injected"]
    assert (injected["kind"], injected["signal"]) == ("segfault", "SIGRTMIN+3")
    # A native crash: no Python error was reported by the worker that died.
    assert not any(e["event"] == "worker_error" and e["worker"] == "worker1" for e in events)
    assert any(e["event"] == "spare_promoted" for e in events)
