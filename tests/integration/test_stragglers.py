"""Stragglers: a worker whose compute is stretched (`fault=slow`, a sleep in proportion to its own compute, as a
throttled device would be) is found by comparing each rank's compute with the others', and its rank moves to a hot
spare at a step boundary (nothing replayed: the fault-free parameters), or is only reported. Nothing healthy is
taken for a straggler, or for failed, under stress: every core busy with other processes, the node agent paused for
half the host timeout, a rank slowed for fewer steps than the window."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from ckptless_core.events import read_events
from tests.conftest import TWO, read_summary

STEPS = 24
"""Slow from step 5: found after `ft.straggler_window_steps` (10 here) slow steps, moved two steps later, then at
full speed to the end (the reference is shared with test_recovery's)."""


def step_seconds(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["step_s"] for record in map(json.loads, lines)}


def test_a_straggler_is_moved_to_a_spare_and_the_steps_after_run_at_full_speed(launch, tmp_path, fault_free_hash):
    run_dir = tmp_path / "moved"
    proc = launch("recipe=tiny_llama", f"trainer.max_steps={STEPS}", "trainer.print_every=1000", *TWO,
                  "fault=slow", "fault.rank=1", "fault.step=5", "fault.factor=3", "ft.straggler_window_steps=10",
                  f"run.dir={run_dir}")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == fault_free_hash(STEPS, *TWO)
    assert not summary["failures"] and not summary["recoveries"], summary
    (straggler,) = summary["stragglers"]
    assert straggler["worker"] == "worker1" and straggler["rank"] == 1 and straggler["moved"], straggler
    assert 2.0 < straggler["ratio"] < 4.0, straggler  # stretched 3x
    (move,) = summary["moves"]
    assert move["reason"] == "straggler" and move["workers"] == {"worker1": "worker2"} and move["completed"], move
    assert move["redone_steps"] == 0 and move["bytes_moved"] > 0, move
    assert "straggler: worker1 (rank 1, local) computed" in proc.stdout and "moved to a spare" in proc.stdout
    seconds = step_seconds(run_dir)
    slowed = statistics.median(seconds[s] for s in range(6, move["after_step"] + 1))
    after = statistics.median(seconds[s] for s in range(move["after_step"] + 2, STEPS + 1))
    assert after < slowed / 1.5, (slowed, after)  # (the straggler's 3x, gone with it)


def test_with_on_straggler_report_a_straggler_is_reported_and_keeps_its_rank(launch, tmp_path, fault_free_hash):
    run_dir = tmp_path / "reported"
    proc = launch("recipe=tiny_llama", f"trainer.max_steps={STEPS}", "trainer.print_every=1000", *TWO,
                  "fault=slow", "fault.rank=1", "fault.step=5", "fault.factor=3", "ft.on_straggler=report",
                  "ft.straggler_window_steps=5", f"run.dir={run_dir}")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == fault_free_hash(STEPS, *TWO)
    (straggler,) = summary["stragglers"]
    assert straggler["worker"] == "worker1" and straggler["action"] == "report" and not straggler["moved"]
    assert not summary["moves"] and not summary["failures"], summary


def test_nothing_healthy_is_taken_for_a_straggler_or_failed_under_stress(launch, tmp_path, fault_free_hash):
    """Every core busy with other processes for the whole run; the node agent paused (SIGSTOP) for half
    `ft.host_timeout_s` mid-run; rank 1 slowed 3x for 10 steps, half the straggler window."""
    run_dir = tmp_path / "stressed"
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL)
        for _ in range(os.cpu_count() or 2)
    ]
    paused = threading.Thread(target=pause_the_agent_once, args=(run_dir,), daemon=True)
    try:
        paused.start()
        proc = launch("recipe=tiny_llama", f"trainer.max_steps={STEPS}", "trainer.print_every=1000", *TWO,
                      "fault=slow", "fault.rank=1", "fault.step=5", "fault.factor=3", "fault.steps=10",
                      f"run.dir={run_dir}")  # fmt: skip
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    paused.join(timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == fault_free_hash(STEPS, *TWO)
    assert not summary["stragglers"] and not summary["moves"] and not summary["failures"], summary
    events = read_events(run_dir / "events")
    assert [e for e in events if e["event"] == "agent_paused"], "the agent was never paused"
    assert not [e for e in events if e["event"] in ("self_fenced", "coordinator_silent", "host_lost")]


def pause_the_agent_once(run_dir: Path, *, host_timeout_s: float = 2.0) -> None:
    """Once step 12 is committed: SIGSTOP the job's node agent for half the host timeout, then SIGCONT; noted in the
    run's events (`events/test.jsonl`)."""
    from ckptless_core.events import EventLog

    deadline = 300
    metrics = run_dir / "metrics.jsonl"
    while deadline > 0 and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 12):
        threading.Event().wait(0.05)
        deadline -= 0.05
    agent = next(p for p in Path("/proc").iterdir() if p.name.isdigit() and b"ckptless_core.agent" in _cmdline(p))
    os.kill(int(agent.name), signal.SIGSTOP)
    threading.Event().wait(host_timeout_s / 2)
    os.kill(int(agent.name), signal.SIGCONT)
    log = EventLog(run_dir / "events" / "test.jsonl", worker="test")
    log.emit("agent_paused", pid=int(agent.name), seconds=host_timeout_s / 2)
    log.close()


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
