"""`python -m launcher.report <run dir> --trace trace.json` on a real run in which a worker was killed and the spare
took its place: the trace parses as JSON and has the tracks a user opens it for in Perfetto."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ckptless_core.events import read_events
from tests.conftest import CHARTED_FAULT_STEP, CHARTED_STEPS
from tests.unit.test_trace import improperly_nested, tracks_of

STEPS, FAULT_STEP = CHARTED_STEPS, CHARTED_FAULT_STEP


@pytest.fixture(scope="module")
def recovered(charted_recovery, tmp_path_factory):
    """(run dir, the report's output, the trace) of tiny_llama with worker1 killed during step FAULT_STEP."""
    root = tmp_path_factory.mktemp("trace")
    _, run_dir = charted_recovery
    report = subprocess.run(
        [sys.executable, "-m", "launcher.report", str(run_dir), "--trace", "t.json", "--no-timeline"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stdout + report.stderr
    return run_dir, report.stdout, json.loads((root / "t.json").read_text())


def on(trace: dict, track: str) -> list[dict]:
    pid, tid = tracks_of(trace)[track]
    return [e for e in trace["traceEvents"] if (e["pid"], e["tid"]) == (pid, tid) and e["ph"] != "M"]


def test_the_report_says_where_it_wrote_the_trace_and_still_reports(recovered):
    _, stdout, _ = recovered
    assert "goodput report:" in stdout and "failures                   1" in stdout
    assert "trace                      t.json (open it in ui.perfetto.dev)" in stdout


def test_each_worker_that_trained_has_a_named_track_of_its_steps_in_order(recovered):
    run_dir, _, trace = recovered
    trained = {e["worker"] for e in read_events(run_dir / "events") if e["event"] == "step_committed"}
    assert trained == {"worker0", "worker1", "worker2"}
    tracks = tracks_of(trace)
    assert {"coordinator", "agent-local", "worker0", "worker1", "worker2 (spare)"} <= set(tracks)
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes[tracks["worker0"][0]] == "host local" and processes[tracks["coordinator"][0]] == "job"
    for track, steps in (("worker0", range(1, STEPS + 1)), ("worker1", range(1, FAULT_STEP))):
        assert [e["args"]["step"] for e in on(trace, track) if e["cat"] == "step"] == list(steps)
    assert [e["args"]["step"] for e in on(trace, "worker2 (spare)") if e["cat"] == "step"] == list(
        range(FAULT_STEP, STEPS + 1)
    )
    assert improperly_nested(trace) == []


def test_the_recovery_phases_are_on_the_survivors_and_the_replacements_tracks(recovered):
    _, _, trace = recovered
    for track in ("worker0", "worker2 (spare)"):
        phases = [e for e in on(trace, track) if e["cat"] == "recovery"]
        assert [e["name"] for e in phases] == ["rebuild", "transfer", "replay"], track
        assert all(e["ph"] == "X" and e["args"]["generation"] == 2 for e in phases)
        transfer = phases[1]["args"]
        assert transfer["source"] == 0 and transfer["step"] == FAULT_STEP - 1
    sent = next(e for e in on(trace, "worker0") if e["name"] == "transfer")["args"]["bytes_moved"]
    assert sent > 0
    replayed = next(e for e in on(trace, "worker2 (spare)") if e["name"] == "replay")
    assert replayed["args"]["step"] == FAULT_STEP


def test_the_failure_is_an_instant_and_the_coordinators_decisions_have_their_track(recovered):
    _, _, trace = recovered
    assert [e["name"] for e in on(trace, "worker1") if e["cat"] == "failure"] == ["fault_injected"]
    detected = [e for e in trace["traceEvents"] if e["name"] == "failure_detected"]
    assert len(detected) == 1 and detected[0]["ph"] == "i" and detected[0]["s"] == "g"
    assert detected[0]["args"]["worker_name"] == "worker1" and detected[0]["args"]["kind"] == "exit"
    noticed = [e for e in on(trace, "worker0") if e["name"] == "failure_noticed"]
    assert len(noticed) == 1 and noticed[0]["s"] == "t"
    coordinator = on(trace, "coordinator")
    generations = [e["args"]["generation"] for e in coordinator if e["name"] == "generation_started"]
    assert generations == [1, 2]
    assert [e["args"]["worker_name"] for e in coordinator if e["name"] == "spare_promoted"] == ["worker2"]
    assert [e["name"] for e in coordinator if e["ph"] == "X"] == ["detect"]
    assert coordinator[-1]["ts"] >= max(e["ts"] for e in on(trace, "worker0"))  # the job's end comes last
