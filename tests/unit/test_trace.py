"""The Chrome trace of a run (`launcher.trace`): tracks per host and worker, steps and recovery phases as nested
complete events, failures as instants; from a hand-written run and from the recorded benchmark runs of both modes."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import pytest

from ckptless_core.events import read_events
from launcher.report import main as report_main
from launcher.trace import chrome_trace, write_trace

T0 = 1_700_000_000.0
RECORDED = Path(__file__).resolve().parents[1] / "data" / "goodput_runs"


def ev(t: float, worker: str, event: str, **fields) -> dict:
    return {"t": T0 + t, "event": event, "worker": worker, "rank": None, **fields}


def kill_events() -> list[dict]:
    """worker1 killed during step 3 at 3.1 s; the hot spare worker2 takes rank 1 (its recovery as workers write
    it: rebuild and transfer written together, the replay just before the replayed step's commit)."""
    events = [
        ev(0.0, "coordinator", "generation_started", generation=1, members={"worker0": 0, "worker1": 1}, world_size=2),
        ev(0.0, "agent-local", "agent_joined", pid=9),
        *[
            ev(0.1, "coordinator", "worker_started", worker_name=f"worker{i}", spare=i == 2, host="local")
            for i in (0, 1, 2)
        ],
        *[ev(0.5, f"worker{i}", "worker_start", pid=10 + i) for i in (0, 1, 2)],
        *[ev(1.0, f"worker{i}", "worker_ready") for i in (0, 1, 2)],
        *[ev(1.0, w, "train_start", step=0) for w in ("worker0", "worker1")],
        *[
            ev(t, w, "step_committed", step=s, step_s=1.0, generation=1)
            for s, t in ((1, 2.0), (2, 3.0))
            for w in ("worker0", "worker1")
        ],
        ev(3.1, "coordinator", "fault_injected", kind="kill_worker", worker_name="worker1", signal="SIGKILL", step=3),
        ev(3.2, "coordinator", "failure_detected", worker_name="worker1", failed_rank=1, kind="exit", step=2),
        ev(3.2, "coordinator", "recovery_phase", phase="detect", generation=2, duration_s=0.1, interrupted_step=3),
        ev(3.2, "coordinator", "spare_promoted", worker_name="worker2", promoted_rank=1),
        ev(3.2, "coordinator", "generation_started", generation=2, members={"worker0": 0, "worker2": 1}, world_size=2),
        ev(3.25, "worker0", "failure_noticed", generation=1, step=2, cause="generation_changed"),
        *[ev(3.6, w, "recovery_phase", phase="rebuild", generation=2, duration_s=0.2) for w in ("worker0", "worker2")],
        *[
            ev(
                3.6,
                w,
                "recovery_phase",
                phase="transfer",
                generation=2,
                duration_s=0.1,
                step=2,
                source=0,
                bytes_moved=b,
            )
            for w, b in (("worker0", 1000), ("worker2", 0))
        ],
        ev(3.6, "worker2", "train_start", step=2),
        ev(4.0, "worker0", "recovery_phase", phase="replay", generation=2, duration_s=0.4, step=3),
        ev(4.0001, "worker0", "step_committed", step=3, step_s=2.0, generation=2),
        ev(4.0, "worker2", "recovery_phase", phase="replay", generation=2, duration_s=0.4, step=3),
        ev(4.0001, "worker2", "step_committed", step=3, step_s=0.39, generation=2),
        ev(4.5, "coordinator", "job_completed", generation=2),
    ]
    return sorted(events, key=lambda e: e["t"])


def tracks_of(trace: dict) -> dict[str, tuple[int, int]]:
    """Thread name -> (pid, tid)."""
    return {e["args"]["name"]: (e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}


def on(trace: dict, track: str, ph: str) -> list[dict]:
    pid, tid = tracks_of(trace)[track]
    return [e for e in trace["traceEvents"] if (e["pid"], e["tid"], e["ph"]) == (pid, tid, ph)]


def improperly_nested(trace: dict) -> list[tuple[str, str]]:
    """Pairs of complete events on one track that overlap without one holding the other (Perfetto drops those)."""
    by_track = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track[e["pid"], e["tid"]].append(e)
    bad = []
    for slices in by_track.values():
        open_: list[dict] = []
        for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while open_ and open_[-1]["ts"] + open_[-1]["dur"] <= e["ts"]:
                open_.pop()
            if open_ and e["ts"] + e["dur"] > open_[-1]["ts"] + open_[-1]["dur"]:
                bad.append((open_[-1]["name"], e["name"]))
            open_.append(e)
    return bad


def test_a_recovered_run_has_a_track_per_worker_with_its_steps_and_phases_and_the_failure_as_instants():
    trace = chrome_trace(kill_events())
    assert trace["displayTimeUnit"] == "ms"
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes == {1: "job", 2: "host local"}
    tracks = tracks_of(trace)
    assert list(tracks) == ["coordinator", "agent-local", "worker0", "worker1", "worker2 (spare)"]
    assert tracks["coordinator"][0] == 1 and {tracks[w][0] for w in ("worker0", "worker1", "worker2 (spare)")} == {2}

    survivor = on(trace, "worker0", "X")
    assert [e["name"] for e in survivor] == ["startup", "step 1", "step 2", "step 3", "rebuild", "transfer", "replay"]
    by_name = {e["name"]: e for e in survivor}
    assert by_name["step 1"]["ts"] == 1_000_000 and by_name["step 1"]["dur"] == 1_000_000  # µs since the first event
    assert by_name["step 1"]["args"] == {"step": 1, "step_s": 1.0, "generation": 1}
    # The phases follow each other: rebuild until the transfer began, replay until the replayed step committed.
    assert (by_name["rebuild"]["ts"], by_name["transfer"]["ts"], by_name["replay"]["ts"]) == (
        3_300_000,
        3_500_000,
        3_600_000,
    )
    assert by_name["replay"]["ts"] + by_name["replay"]["dur"] == by_name["step 3"]["ts"] + by_name["step 3"]["dur"]
    assert by_name["transfer"]["args"]["bytes_moved"] == 1000 and by_name["transfer"]["args"]["source"] == 0
    spare = [e["name"] for e in on(trace, "worker2 (spare)", "X")]
    assert spare == ["startup", "rebuild", "transfer", "replay", "step 3"]
    assert improperly_nested(trace) == []

    assert [e["name"] for e in on(trace, "worker1", "i")] == ["train_start", "fault_injected"]
    assert [e["name"] for e in on(trace, "worker0", "i")] == ["train_start", "failure_noticed"]
    detected = next(e for e in trace["traceEvents"] if e["name"] == "failure_detected")
    assert detected["s"] == "g" and detected["cat"] == "failure" and detected["args"]["worker_name"] == "worker1"
    decisions = [e["name"] for e in on(trace, "coordinator", "i") if e["cat"] == "decision"]
    assert decisions[-3:] == ["spare_promoted", "generation_started", "job_completed"]
    assert [(e["name"], e["ts"], e["dur"]) for e in on(trace, "coordinator", "X")] == [("detect", 3_100_000, 100_000)]


def test_the_trace_is_the_same_json_each_time(tmp_path):
    first = write_trace(kill_events(), tmp_path / "a" / "trace.json").read_text()
    assert write_trace(kill_events(), tmp_path / "b.json").read_text() == first
    assert json.loads(first) == chrome_trace(kill_events())
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}


@pytest.mark.parametrize("name", ["ckptless_A", "checkpoint_restart_A"])
def test_recorded_runs_give_properly_nested_tracks(name, tmp_path):
    for path in (RECORDED / name / "events").glob("*.jsonl.gz"):
        (tmp_path / path.name.removesuffix(".gz")).write_bytes(gzip.decompress(path.read_bytes()))
    trace = chrome_trace(read_events(tmp_path))
    assert improperly_nested(trace) == []
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert len(steps) > 1000
    names = {e["name"] for e in trace["traceEvents"]}
    if name.startswith("ckptless"):
        assert {"detect", "rebuild", "transfer", "replay", "failure_detected"} <= names
    else:  # torchrun restarts every worker; each loads the last checkpoint, on its own track beside its steps
        assert {"checkpoint write", "checkpoint load", "fault_injected"} <= names
        assert "worker0 checkpoints" in tracks_of(trace)


def test_report_writes_the_trace_even_of_a_run_it_cannot_report_on(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "events").mkdir(parents=True)
    (run_dir / "events" / "worker0.jsonl").write_text(json.dumps(ev(0.0, "worker0", "worker_start", pid=10)) + "\n")
    code = report_main([str(run_dir), "--trace", str(tmp_path / "out" / "trace.json"), "--no-timeline"])
    assert code == 2  # no config.yaml, no step: no goodput
    assert f"trace                      {tmp_path / 'out' / 'trace.json'}" in capsys.readouterr().out
    assert tracks_of(json.loads((tmp_path / "out" / "trace.json").read_text())) == {"worker0": (1, 1)}


def test_report_refuses_a_folder_as_the_trace(tmp_path, capsys):
    (tmp_path / "events").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        report_main([str(tmp_path), "--trace", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "is a folder: give the path of the file to write" in capsys.readouterr().err
