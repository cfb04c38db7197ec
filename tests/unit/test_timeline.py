"""The run timeline: each worker's states from hand-written event lists (checkpointless with a spare, a hang, the
torchrun checkpoint-restart baseline), and the PNG drawn from them."""

from pathlib import Path

import pytest

from launcher.timeline import Segment, plot_timeline, timeline

T0 = 1_700_000_000.0


def ev(t: float, worker: str, event: str, **fields) -> dict:
    return {"t": T0 + t, "event": event, "worker": worker, "rank": None, **fields}


def steps(at: list[float], *, first: int, workers: tuple[str, ...] = ("worker0", "worker1")) -> list[dict]:
    return [
        ev(t, w, "step_committed", step=first + i, step_s=0.5, generation=1) for i, t in enumerate(at) for w in workers
    ]


def spans(segments: list[Segment]) -> list[tuple[str, float, float]]:
    return [(s.state, round(s.start_s, 6), round(s.end_s, 6)) for s in segments]


def ckptless_kill_events() -> list[dict]:
    """worker1 killed at 5.0 s; the hot spare worker2 takes rank 1; worker3 is started as the next spare."""
    events = [
        ev(0.0, "coordinator", "worker_started", worker_name="worker0", pid=10, spare=False),
        ev(0.0, "coordinator", "worker_started", worker_name="worker1", pid=11, spare=False),
        ev(0.0, "coordinator", "generation_started", generation=1, members={"worker0": 0, "worker1": 1}, world_size=2),
        ev(0.1, "coordinator", "worker_started", worker_name="worker2", pid=12, spare=True),
        *[ev(0.5, w, "worker_start", pid=10 + i, attempt=0) for i, w in enumerate(("worker0", "worker1", "worker2"))],
        *[ev(1.0, w, e, step=0) for w in ("worker0", "worker1") for e in ("worker_ready", "joined", "train_start")],
        ev(1.2, "worker2", "worker_ready"),
        *steps([2.0, 2.5, 3.0, 3.5, 4.0], first=1),
        ev(3.0, "worker0", "checkpoint_written", step=3, duration_s=0.5, blocked_s=0.01),
        ev(5.0, "coordinator", "fault_injected", kind="kill_worker", worker_name="worker1", signal="SIGKILL", step=6),
        ev(5.1, "coordinator", "failure_detected", worker_name="worker1", failed_rank=1, kind="exit", step=5),
        ev(5.1, "coordinator", "recovery_phase", phase="detect", generation=2, duration_s=0.1),
        ev(5.1, "coordinator", "spare_promoted", worker_name="worker2", promoted_rank=1),
        ev(5.1, "coordinator", "generation_started", generation=2, members={"worker0": 0, "worker2": 1}, world_size=2),
        ev(5.2, "worker0", "failure_noticed", generation=1, step=5, cause="peer_failure"),
        *[
            ev(5.6, w, "recovery_phase", phase=p, generation=2, duration_s=0.2)
            for w in ("worker0", "worker2")
            for p in ("rebuild", "transfer")
        ],
        *[ev(5.6, w, "joined", generation=2, world_size=2, step=5) for w in ("worker0", "worker2")],
        ev(5.6, "worker2", "train_start", step=5),
        ev(6.0, "worker0", "recovery_phase", phase="replay", generation=2, duration_s=0.4, step=6),
        ev(6.0, "worker0", "step_committed", step=6, step_s=0.8, generation=2),
        ev(6.1, "worker2", "recovery_phase", phase="replay", generation=2, duration_s=0.5, step=6),
        ev(6.1, "worker2", "step_committed", step=6, step_s=0.5, generation=2),
        ev(7.0, "coordinator", "worker_started", worker_name="worker3", pid=13, spare=True),
        ev(7.5, "worker3", "worker_start", pid=13, attempt=0),
        ev(8.0, "worker3", "worker_ready"),
        *steps([8.5], first=7, workers=("worker0", "worker2")),
        ev(9.0, "worker0", "train_end", step=7),
        ev(9.0, "worker2", "train_end", step=7),
        ev(9.5, "coordinator", "job_completed", generation=2),
    ]
    return sorted(events, key=lambda e: e["t"])


def ckptless_hang_events() -> list[dict]:
    """worker1 stopped (SIGSTOP) at 3.0 s, fenced when its heartbeat times out at 5.0 s; no spare: the job shrinks."""
    events = [
        ev(0.0, "coordinator", "worker_started", worker_name="worker0", pid=10, spare=False),
        ev(0.0, "coordinator", "worker_started", worker_name="worker1", pid=11, spare=False),
        *[
            ev(1.0, w, e, step=0)
            for w in ("worker0", "worker1")
            for e in ("worker_start", "worker_ready", "train_start")
        ],
        *steps([2.0], first=1),
        ev(3.0, "coordinator", "fault_injected", kind="hang", worker_name="worker1", signal="SIGSTOP", step=2),
        ev(5.0, "coordinator", "worker_fenced", worker_name="worker1", exit_code=-9),
        ev(5.0, "worker0", "failure_noticed", generation=1, step=1, cause="peer_failure"),
        ev(5.0, "coordinator", "failure_detected", worker_name="worker1", failed_rank=1, kind="hang", step=1),
        ev(5.0, "coordinator", "job_shrunk", world_size=1, lost_ranks=[1], demoted=[]),
        ev(5.5, "worker0", "recovery_phase", phase="replay", generation=2, duration_s=0.3, step=2),
        ev(5.5, "worker0", "step_committed", step=2, step_s=0.3, generation=2),
        ev(6.0, "worker0", "train_end", step=2),
        ev(6.2, "coordinator", "job_completed", generation=2),
    ]
    return sorted(events, key=lambda e: e["t"])


def checkpoint_restart_events(*, injected: bool = True) -> list[dict]:
    """torchrun, 2 workers, a checkpoint at step 4; worker1 dies during step 7 (killed by the launcher at 5.2 s, or
    found exited at 5.3 s); torchrun restarts both, they load step 4 and redo steps 5-7."""
    fault = (
        [
            ev(
                5.2,
                "launcher",
                "fault_injected",
                kind="kill_worker",
                worker_name="worker1",
                signal="SIGKILL",
                step=7,
                attempt=0,
            )
        ]
        if injected
        else [ev(5.3, "launcher", "worker_exited", worker_name="worker1", pid=11, attempt=0, target_rank=1)]
    )
    events = [
        ev(0.0, "launcher", "torchrun_started", pid=9),
        ev(1.0, "worker0", "worker_start", pid=10, attempt=0),
        ev(1.1, "worker1", "worker_start", pid=11, attempt=0),
        *[ev(2.0, w, e, step=0) for w in ("worker0", "worker1") for e in ("worker_ready", "joined", "train_start")],
        *steps([2.5, 3.0, 3.5, 4.0], first=1),
        ev(4.2, "worker0", "checkpoint_written", step=4, duration_s=0.2, blocked_s=0.2),
        *steps([4.5, 5.0], first=5),
        *fault,
        ev(5.4, "launcher", "worker_exited", worker_name="worker0", pid=10, attempt=0, target_rank=0),
        ev(5.4, "launcher", "worker_exited", worker_name="worker1", pid=11, attempt=0, target_rank=1),
        ev(7.0, "worker0", "worker_start", pid=20, attempt=1),
        ev(7.1, "worker1", "worker_start", pid=21, attempt=1),
        *[ev(8.0, w, "checkpoint_loaded", step=4, duration_s=0.1) for w in ("worker0", "worker1")],
        *[ev(8.0, w, e, step=4) for w in ("worker0", "worker1") for e in ("worker_ready", "joined", "train_start")],
        *steps([8.5, 9.0, 9.5, 10.0], first=5),
        ev(10.2, "worker0", "train_end", step=8),
        ev(10.2, "worker1", "train_end", step=8),
        ev(10.5, "launcher", "worker_exited", worker_name="worker0", pid=20, attempt=1, target_rank=0),
        ev(10.5, "launcher", "worker_exited", worker_name="worker1", pid=21, attempt=1, target_rank=1),
        ev(10.6, "launcher", "torchrun_exited", exit_code=0),
    ]
    return sorted(events, key=lambda e: e["t"])


def test_ckptless_kill_killed_worker_is_dead_and_spare_takes_over():
    rows = timeline(ckptless_kill_events())
    assert list(rows) == ["worker0", "worker1", "worker2", "worker3"]
    assert spans(rows["worker0"]) == [
        ("starting", 0.0, 1.0),
        ("training", 1.0, 2.5),
        ("checkpointing", 2.5, 3.0),
        ("training", 3.0, 5.2),
        ("recovering", 5.2, 6.0),
        ("training", 6.0, 9.0),
        ("finished", 9.0, 9.5),
    ]
    assert spans(rows["worker1"]) == [("starting", 0.0, 1.0), ("training", 1.0, 5.0), ("dead", 5.0, 9.5)]
    assert spans(rows["worker2"]) == [
        ("starting", 0.1, 1.2),
        ("idle spare", 1.2, 5.1),
        ("recovering", 5.1, 6.1),
        ("training", 6.1, 9.0),
        ("finished", 9.0, 9.5),
    ]
    assert spans(rows["worker3"]) == [("starting", 7.0, 8.0), ("idle spare", 8.0, 9.5)]


def test_ckptless_hang_is_hung_until_fenced_then_dead():
    rows = timeline(ckptless_hang_events())
    assert spans(rows["worker1"]) == [
        ("starting", 0.0, 1.0),
        ("training", 1.0, 3.0),
        ("hung", 3.0, 5.0),
        ("dead", 5.0, 6.2),
    ]
    assert spans(rows["worker0"])[-3:] == [("recovering", 5.0, 5.5), ("training", 5.5, 6.0), ("finished", 6.0, 6.2)]


def test_demoted_member_waits_as_idle_spare():
    events = [
        *[e for e in ckptless_hang_events() if e["t"] <= T0 + 5.0],
        ev(5.1, "worker0", "demoted_to_spare", generation=2),
        ev(6.0, "coordinator", "job_abandoned", reason="no_spare"),
    ]
    assert spans(timeline(events)["worker0"])[-2:] == [("recovering", 5.0, 5.1), ("idle spare", 5.1, 6.0)]


def test_checkpoint_restart_kill_dead_until_restart_then_recovers_and_redoes_lost_steps():
    rows = timeline(checkpoint_restart_events())
    assert spans(rows["worker0"]) == [
        ("starting", 1.0, 2.0),
        ("training", 2.0, 4.0),
        ("checkpointing", 4.0, 4.2),
        ("training", 4.2, 5.2),
        ("recovering", 5.2, 5.4),  # alive, stuck with a dead peer until torchrun tears it down
        ("dead", 5.4, 7.0),
        ("recovering", 7.0, 8.0),  # the restarted process: build, load the checkpoint, rendezvous
        ("redoing", 8.0, 9.5),  # steps 5-7 again, up to the interrupted one
        ("training", 9.5, 10.2),
        ("finished", 10.2, 10.6),
    ]
    assert spans(rows["worker1"]) == [
        ("starting", 1.1, 2.0),
        ("training", 2.0, 5.2),
        ("dead", 5.2, 7.1),
        ("recovering", 7.1, 8.0),
        ("redoing", 8.0, 9.5),
        ("training", 9.5, 10.2),
        ("finished", 10.2, 10.6),
    ]


def test_checkpoint_restart_crash_without_injection_starts_at_the_first_exit():
    rows = timeline(checkpoint_restart_events(injected=False))
    assert ("dead", 5.3, 7.1) in spans(rows["worker1"])
    assert ("recovering", 5.3, 5.4) in spans(rows["worker0"])


@pytest.mark.parametrize(
    "events",
    [ckptless_kill_events(), ckptless_hang_events(), checkpoint_restart_events()],
    ids=["kill", "hang", "restart"],
)
def test_rows_are_ordered_without_overlaps_and_end_at_the_last_event(events):
    end_s = events[-1]["t"] - events[0]["t"]
    for name, segments in timeline(events).items():
        assert segments, name
        for before, after in zip(segments, segments[1:], strict=False):
            assert before.end_s == pytest.approx(after.start_s), name
            assert before.state != after.state, name
        assert all(s.start_s < s.end_s for s in segments), name
        assert segments[-1].end_s == pytest.approx(end_s), name


def test_rows_sort_by_worker_number():
    events = [ev(0.0, f"worker{i}", "worker_start", attempt=0) for i in (10, 2, 1)] + [ev(1.0, "launcher", "x")]
    assert list(timeline(events)) == ["worker1", "worker2", "worker10"]
    assert timeline([]) == {}


@pytest.mark.parametrize("events", [ckptless_kill_events(), checkpoint_restart_events()], ids=["ckptless", "restart"])
def test_plot_timeline_writes_a_png(events, tmp_path: Path):
    path = plot_timeline(events, tmp_path / "out" / "timeline.png", title="a run")
    assert path == tmp_path / "out" / "timeline.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


def test_plot_timeline_without_workers_says_so(tmp_path: Path):
    with pytest.raises(ValueError, match="no worker events"):
        plot_timeline([ev(0.0, "launcher", "torchrun_started")], tmp_path / "t.png")
