"""The goodput report on small hand-written event logs whose numbers are worked out by hand below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.goodput import report_from_events
from launcher.report import main as report_main
from recipes.schema import JobConfig, save_config


def ev(t: float, event: str, worker: str, **fields) -> dict:
    rank = fields.pop("rank", int(worker[-1]) if worker.startswith("worker") else None)
    return {"t": t, "event": event, "worker": worker, "rank": rank, **fields}


def steps(worker: str, first: int, last: int, *, t0: float, generation: int) -> list[dict]:
    """Steps `first..last` committed one second apart, the first at `t0`."""
    return [
        ev(t0 + i, "step_committed", worker, step=s, step_s=0.9, generation=generation, loss=1.0)
        for i, s in enumerate(range(first, last + 1))
    ]


def ckptless_run() -> list[dict]:
    """Training starts at t=100; steps 1-5 commit at 101..105. worker1 is killed at 105.5 (in step 6); the
    supervisor sees it at 106.0; the new generation rebuilds (0.5 s), moves the state of step 5 (0.5 s) and commits
    step 6 again at 108.0; steps 7-10 follow at 109..112. A checkpoint write blocks 0.2 s at 103.2.

    By hand: wall 112 - 100 = 12 s; fault-free step time 1 s (every step-to-step interval); productive 10 x 1 s;
    goodput 10/12; time lost to the failure 108.0 - 105.5 = 2.5 s."""
    events = [ev(100.0, "train_start", w, step=0, world_size=2) for w in ("worker0", "worker1")]
    for w in ("worker0", "worker1"):
        events += steps(w, 1, 5, t0=101.0, generation=1)
    events += [
        ev(103.2, "checkpoint_written", "worker0", step=3, duration_s=0.2, blocked_s=0.2, bytes=1000, path="x"),
        ev(105.6, "fault_injected", "coordinator", kind="kill_worker", worker_name="worker1", target_rank=1, step=6),
        ev(
            106.0,
            "failure_detected",
            "coordinator",
            worker_name="worker1",
            failed_rank=1,
            kind="exit",
            step=5,
            detail="killed by SIGKILL",
            detected_by="process_exit",
            generation=1,
        ),
        ev(
            106.0,
            "recovery_phase",
            "coordinator",
            phase="detect",
            generation=2,
            duration_s=0.5,
            failed_at=105.5,
            interrupted_step=6,
        ),
    ]
    for w in ("worker0", "worker2"):
        events += [
            ev(106.5, "recovery_phase", w, rank=int(w == "worker2"), phase="rebuild", generation=2, duration_s=0.5),
            ev(
                107.0,
                "recovery_phase",
                w,
                rank=int(w == "worker2"),
                phase="transfer",
                generation=2,
                duration_s=0.5,
                step=5,
                source=0,
                receivers=[1],
                bytes_moved=500 if w == "worker0" else 0,
            ),
            ev(
                108.0,
                "recovery_phase",
                w,
                rank=int(w == "worker2"),
                phase="replay",
                generation=2,
                duration_s=1.0,
                step=6,
            ),
        ]
        events += steps(w, 6, 10, t0=108.0, generation=2)
    return sorted(events, key=lambda e: e["t"])


def restart_run() -> list[dict]:
    """torchrun attempt 0 trains from t=10 (steps 1-4 at 11..14; a checkpoint of step 2). worker1 is killed at
    14.5; the launcher sees worker1 gone at 14.55 and worker0 (stopped by torchrun) at 14.7. Attempt 1 starts at
    16.0, loads step 2 (0.3 s), trains from 18.2 and redoes steps 3, 4 and the interrupted step 5 (at 21.2);
    steps 6-8 follow at 22.2..24.2.

    By hand: detect 14.7 - 14.5 = 0.2; rebuild 18.2 - 14.7 - 0.3 = 3.2; transfer (load) 0.3; replay 21.2 - 18.2 = 3.0;
    time to recover 21.2 - 14.5 = 6.7 s; 2 steps redone. Wall 24.2 - 10 = 14.2 s, productive 8 x 1 s."""
    events = []
    for w in ("worker0", "worker1"):
        events += [ev(8.0, "worker_start", w, pid=100 + int(w[-1]), attempt=0), ev(10.0, "train_start", w, step=0)]
        events += steps(w, 1, 4, t0=11.0, generation=1)
    events += [
        ev(1.0, "torchrun_started", "launcher", pid=99, command=[]),
        ev(12.1, "checkpoint_written", "worker0", step=2, duration_s=0.1, blocked_s=0.1, bytes=1000, path="x"),
        ev(
            14.5,
            "fault_injected",
            "launcher",
            kind="kill_worker",
            worker_name="worker1",
            target_rank=1,
            step=5,
            attempt=0,
        ),
        ev(14.55, "worker_exited", "launcher", worker_name="worker1", pid=101, attempt=0, target_rank=1),
        ev(14.7, "worker_exited", "launcher", worker_name="worker0", pid=100, attempt=0, target_rank=0),
    ]
    for w in ("worker0", "worker1"):
        events += [
            ev(16.0, "worker_start", w, pid=200 + int(w[-1]), attempt=1),
            ev(18.0, "checkpoint_loaded", w, step=2, duration_s=0.3, path="x"),
            ev(18.2, "train_start", w, step=2),
        ]
        events += steps(w, 3, 8, t0=19.2, generation=2)
    return sorted(events, key=lambda e: e["t"])


def test_ckptless_goodput_and_recovery_by_hand():
    report = report_from_events(ckptless_run(), mode="ckptless", world_size=2, spares=1)
    assert report["train_wall_s"] == pytest.approx(12.0)
    assert report["step_s"] == pytest.approx(1.0)
    assert report["goodput"] == pytest.approx(10 / 12)
    assert report["failures"] == 1
    assert report["lost_per_failure_s"]["median"] == pytest.approx(2.5)
    assert report["phases_s"] == pytest.approx({"detect_s": 0.5, "rebuild_s": 0.5, "transfer_s": 0.5, "replay_s": 1.0})
    assert report["recoveries"][0]["bytes_moved"] == 500
    assert report["redone_steps"] == 0
    assert report["checkpoint"]["overhead_s"] == pytest.approx(0.2)
    assert report["spare_overhead"] == pytest.approx(0.5)  # one spare held beside two workers


def test_checkpoint_restart_phases_by_hand():
    report = report_from_events(restart_run(), mode="checkpoint_restart", world_size=2, spares=0)
    (recovery,) = report["recoveries"]
    assert recovery["completed"] and recovery["interrupted_step"] == 5
    assert recovery["detect_s"] == pytest.approx(0.2)
    assert recovery["rebuild_s"] == pytest.approx(3.2)
    assert recovery["transfer_s"] == pytest.approx(0.3)
    assert recovery["replay_s"] == pytest.approx(3.0)
    assert recovery["time_to_recover_s"] == pytest.approx(6.7)
    assert recovery["redone_steps"] == 2
    assert report["goodput"] == pytest.approx(8 / 14.2)
    assert report["checkpoint"]["load_s"] == pytest.approx(0.3)


def test_given_fault_free_step_time_is_used():
    report = report_from_events(ckptless_run(), mode="ckptless", world_size=2, spares=1, step_s=0.9)
    assert report["goodput"] == pytest.approx(10 * 0.9 / 12)


def test_a_resumed_run_counts_only_the_steps_it_trained():
    """Resumed at step 10, steps 11-15 commit at 101..105: 5 steps x 0.9 s in 5 s of training."""
    events = [ev(100.0, "train_start", "worker0", step=10), *steps("worker0", 11, 15, t0=101.0, generation=1)]
    report = report_from_events(events, mode="ckptless", world_size=1, spares=0, step_s=0.9)
    assert report["steps"] == 5 and report["goodput"] == pytest.approx(5 * 0.9 / 5)


def write_run(run_dir: Path, events: list[dict], *, mode: str) -> Path:
    (run_dir / "events").mkdir(parents=True)
    job = JobConfig()
    job.ft.mode, job.ft.spares, job.cluster.nproc = mode, 1, 2
    save_config(job, run_dir / "config.yaml")
    by_worker: dict[str, list[str]] = {}
    for e in events:
        by_worker.setdefault(e["worker"], []).append(json.dumps(e))
    for worker, lines in by_worker.items():
        (run_dir / "events" / f"{worker}.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_report_command_prints_the_table_and_prices_the_lost_time(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", ckptless_run(), mode="ckptless")
    code = report_main([str(run_dir), "--price-per-hour", "3", "--watts", "500", "--no-timeline"])
    out = capsys.readouterr().out
    assert code == 0
    assert "goodput                    83.3 %" in out and "2.50 s median" in out
    saved = json.loads((run_dir / "goodput.json").read_text())
    lost_hours = 2.0 * 2 / 3600  # 2 s lost (12 s wall - 10 s productive) on each of 2 workers
    assert saved["cost"]["lost_accelerator_hours"] == pytest.approx(lost_hours)
    assert saved["cost"]["lost_money"] == pytest.approx(lost_hours * 3)
    assert saved["cost"]["lost_kwh"] == pytest.approx(lost_hours * 0.5)
    assert saved["cost"]["per_1000_hours"]["lost_accelerator_hours"] == pytest.approx(1000 * 2 / 12)


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report_main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "not a run directory" in capsys.readouterr().err
