"""Checkpointless recovery under real faults: worker processes are killed, stopped or made to raise by signals
from the supervisor, and the final parameters are compared bitwise with a run that had no failure."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ckptless_core.events import read_events
from launcher.summary import with_attempts
from tests.conftest import FOUR, THREE, TWO, read_metrics, read_summary

STEPS = 24
FAULT_STEP = 12
"""Every fault case runs in a layout (TWO, THREE, FOUR workers) with enough workers and spares that a healthy copy
of the state and a spare always exist."""
LONG_STEPS = 40
"""The steps of a case that needs time for a new spare to start (the reference is shared with test_control's, among
others)."""


@pytest.fixture(scope="module")
def run(launch, tmp_path_factory):
    """Run tiny_llama for STEPS steps with `overrides`; returns (process, run_dir)."""
    root = tmp_path_factory.mktemp("recovery")

    def go(name: str, *overrides: str):
        run_dir = root / name
        proc = launch(
            "recipe=tiny_llama",
            f"trainer.max_steps={STEPS}",
            "trainer.print_every=100",
            *overrides,
            f"run.dir={run_dir}",
        )
        return proc, run_dir

    return go


@pytest.fixture(scope="module")
def fault_free(fault_free_hash):
    """The reference hash of each layout at STEPS steps, from a run without failures (shared by the session)."""
    return lambda layout: fault_free_hash(STEPS, *layout)


def assert_recovered(proc, run_dir, *, expected_hash: str, failures: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["param_sha256"] == expected_hash  # bitwise the run that never failed
    assert len(summary["failures"]) == failures
    completed = [r for r in summary["recoveries"] if r["completed"]]
    assert completed, summary["recoveries"]
    for recovery in completed:
        assert recovery["time_to_recover_s"] > 0
        assert recovery["time_to_recover_s"] >= recovery["rebuild_s"] + recovery["transfer_s"]
    return summary


def test_a_killed_worker_is_replaced_by_the_spare_and_the_run_is_bitwise_unchanged(run, fault_free):
    proc, run_dir = run("kill", *TWO, "fault=kill_worker", "fault.rank=1", f"fault.step={FAULT_STEP}")
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free(TWO), failures=1)
    failure = summary["failures"][0]
    assert (failure["rank"], failure["kind"], failure["detected_by"]) == (1, "exit", "process_exit")
    assert failure["step"] == FAULT_STEP
    recovery = summary["recoveries"][0]
    assert recovery["bytes_moved"] > 0 and recovery["world_size"] == 2
    assert summary["final_world_size"] == 2
    assert "failure: worker1 (rank 1)" in proc.stdout and "recovered:" in proc.stdout
    phases = [e["phase"] for e in read_events(run_dir / "events") if e["event"] == "recovery_phase"]
    assert set(phases) == {"detect", "rebuild", "transfer", "replay"}
    # The supervisor started a new spare after the promotion.
    started = [e for e in read_events(run_dir / "events") if e["event"] == "worker_started"]
    assert len(started) == 4
    # Each worker binds its agent's lowest free slot (LOCAL_RANK, its device): the spare one of its own, the new
    # spare the slot the killed worker freed.
    slots = {e["worker"]: e["local_rank"] for e in read_events(run_dir / "events") if e["event"] == "worker_start"}
    assert slots == {"worker0": 0, "worker1": 1, "worker2": 2, "worker3": 1}


def test_an_exception_in_forward_is_recovered_in_place_without_a_spare(run, fault_free):
    proc, run_dir = run("exception", *TWO, "ft.spares=0", "fault=exception", f"fault.step={FAULT_STEP}")
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free(TWO), failures=1)
    assert summary["failures"][0]["detected_by"] == "worker_report"
    assert summary["final_world_size"] == 2
    assert summary["recoveries"][0]["bytes_moved"] == 0  # the worker kept its own state


def test_a_hung_worker_is_detected_by_heartbeat_fenced_and_replaced(run, fault_free):
    proc, run_dir = run("hang", *TWO, "fault=hang", f"fault.step={FAULT_STEP}", "ft.heartbeat_timeout_s=2")
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free(TWO), failures=1)
    assert summary["failures"][0]["detected_by"] == "heartbeat"
    # Silent for the timeout, counted from its last heartbeat (up to one interval before the stop).
    assert summary["recoveries"][0]["detect_s"] >= 2 - 0.5
    assert any(e["event"] == "worker_fenced" for e in read_events(run_dir / "events"))


def test_two_workers_killed_at_once(run, fault_free):
    proc, run_dir = run(
        "two",
        *FOUR,
        "ft.spares=2",
        "fault=two_kills",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_worker,rank:2,step:{FAULT_STEP}}}]",
    )
    assert_recovered(proc, run_dir, expected_hash=fault_free(FOUR), failures=2)


def test_a_kill_during_a_recovery_in_progress(run, fault_free):
    proc, run_dir = run(
        "in-recovery",
        *THREE,
        "ft.spares=2",
        "fault=kill_in_recovery",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_in_recovery,rank:2,step:{FAULT_STEP}}}]",
    )
    assert_recovered(proc, run_dir, expected_hash=fault_free(THREE), failures=2)


def test_a_kill_of_the_worker_sending_state(run, fault_free):
    proc, run_dir = run(
        "sender",
        *THREE,
        "ft.spares=2",
        "fault=kill_sender",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_sender,step:{FAULT_STEP}}}]",
    )
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free(THREE), failures=2)
    assert any(e["event"] == "fault_injected" and e["kind"] == "kill_sender" for e in read_events(run_dir / "events"))
    assert summary["final_world_size"] == 3


def test_a_killed_spare_is_replaced(run, fault_free):
    proc, run_dir = run("spare", *TWO, "fault=kill_spare", "fault.step=5")
    assert proc.returncode == 0, proc.stderr
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == fault_free(TWO)
    events = read_events(run_dir / "events")
    assert any(e["event"] == "spare_lost" for e in events)
    assert sum(e["event"] == "worker_started" and e["spare"] for e in events) == 2


def test_without_a_spare_the_job_shrinks_and_keeps_the_global_batch(run, fault_free):
    # Two workers halve to one with the micro-batch kept: the same sums in the same order, so the same bits.
    proc, run_dir = run("shrink", *TWO, "ft.spares=0", "fault=kill_worker", f"fault.step={FAULT_STEP}")
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free(TWO), failures=1)
    assert summary["final_world_size"] == 1
    assert any(e["event"] == "job_shrunk" for e in read_events(run_dir / "events"))


def test_repeated_failures_without_progress_end_the_job_with_a_distinct_code(run):
    proc, run_dir = run(
        "no-progress",
        *THREE,
        "ft.spares=2",
        "ft.max_failures_without_progress=1",
        "fault=kill_in_recovery",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_in_recovery,rank:2,step:{FAULT_STEP}}}]",
    )
    assert proc.returncode == 4, proc.stdout[-2000:]
    assert "without a committed step" in read_summary(run_dir)["message"]


def test_without_fault_tolerance_a_kill_ends_the_job(run):
    proc, run_dir = run("ft-none", *TWO, "ft=none", "fault=kill_worker", f"fault.step={FAULT_STEP}")
    assert proc.returncode == 3
    assert read_summary(run_dir)["status"] == "failed"


def test_chaos_kills_at_random_moments_and_the_run_is_bitwise_unchanged(run, fault_free):
    # Seed 0, mean 0.5 s: two kills about 0.93 s after the first step, close together (the second may hit the first's
    # victim).
    proc, run_dir = run(
        "chaos", *TWO, "ft.spares=2", "fault=chaos", "fault.mtbf_s=0.5", "fault.seed=0", "fault.max_faults=2"
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == fault_free(TWO)
    injected = [e for e in read_events(run_dir / "events") if e["event"] == "fault_injected"]
    assert len(injected) == 2 and all(e["kind"] == "chaos" for e in injected)
    assert summary["failures"] and all(f["kind"] == "exit" for f in summary["failures"])


def test_nothing_leaks_over_twenty_recoveries(launch, tmp_path):
    # An exception every other step: 20 recoveries in place (no spare involved).
    faults = ",".join(f"{{kind:exception,rank:1,step:{step}}}" for step in range(3, 43, 2))
    proc = launch(
        "recipe=tiny_llama",
        "trainer.max_steps=50",
        *TWO,
        "ft.spares=0",
        f"fault.more=[{faults}]",
        "trainer.print_every=100",
        f"run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and len(summary["failures"]) == 20
    assert sum(r["completed"] for r in summary["recoveries"]) == 20
    events = read_events(tmp_path / "events")
    for worker in ("worker0", "worker1"):
        phases = [
            e for e in events if e["event"] == "recovery_phase" and e["worker"] == worker and e["phase"] == "transfer"
        ]
        assert len(phases) == 20
        # After the first recoveries warm up, open files and threads stay flat.
        assert {p["open_files"] for p in phases[5:]} == {phases[5]["open_files"]}, worker
        assert {p["threads"] for p in phases[5:]} == {phases[5]["threads"]}, worker
    # Each generation's process group writes ~10 keys; the supervisor deletes old generations' keys, so the
    # count stays flat (up to a worker's one-off report key appearing).
    store_keys = [e["store_keys"] for e in events if e["event"] == "generation_started"]
    assert len(store_keys) == 21 and max(store_keys[5:]) - min(store_keys[5:]) <= 2


def test_silent_corruption_is_caught_by_the_replica_check_and_the_majority_repairs_it_bitwise(run, fault_free):
    # Three copies: the two that agree outvote the corrupted one, even when it is the lowest rank's.
    proc, run_dir = run(
        "corrupt", *THREE, "ft.check_every=2", "fault=corrupt", "fault.rank=0", f"fault.step={FAULT_STEP}"
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["param_sha256"] == fault_free(THREE)
    divergence = [e for e in read_events(run_dir / "events") if e["event"] == "divergence_detected"]
    assert divergence and divergence[0]["outlier_ranks"] == [0] and divergence[0]["resolution"] == "majority"
    assert summary["recoveries"] and summary["recoveries"][0]["bytes_moved"] > 0


def test_with_no_healthy_replica_left_recovery_falls_back_to_the_disk_checkpoint(run, fault_free):
    proc, run_dir = run(
        "fallback",
        *TWO,
        "ft.spares=2",
        "ft.checkpoint_every=5",
        "fault=kill_worker",
        "fault.rank=0",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_worker,rank:1,step:{FAULT_STEP}}}]",
    )
    assert_recovered(proc, run_dir, expected_hash=fault_free(TWO), failures=2)
    fallbacks = [e for e in read_events(run_dir / "events") if e["event"] == "checkpoint_fallback"]
    assert fallbacks and all(e["step"] == 10 for e in fallbacks)
    assert "loaded the latest disk checkpoint" in proc.stdout


def test_a_shrunken_job_grows_back_when_a_new_spare_is_ready(launch, tmp_path, fault_free_hash):
    # Kills in quick succession: the spare replaces the first victim; a later kill comes before the next spare
    # is ready, so the job shrinks to one worker, then takes the new spare back (2 -> 1 -> 2 keeps the bits).
    # Longer than the other cases, so the new spare has time to start and the job to grow before the end (a new
    # spare joins within a second of the kill; 30 steps are left).
    proc = launch(
        "recipe=tiny_llama",
        f"trainer.max_steps={LONG_STEPS}",
        "trainer.print_every=100",
        *TWO,
        "fault=kill_worker",
        "fault.step=8",
        "fault.more=[{kind:kill_worker,rank:1,step:9},{kind:kill_worker,rank:1,step:10}]",
        f"run.dir={tmp_path / 'grow'}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = read_summary(tmp_path / "grow")
    assert summary["param_sha256"] == fault_free_hash(LONG_STEPS, *TWO)
    events = read_events(tmp_path / "grow" / "events")
    reasons = [e["reason"] for e in events if e["event"] == "generation_started"]
    assert any(e["event"] == "job_shrunk" for e in events) and "grow" in reasons
    assert summary["final_world_size"] == 2


def test_shrinking_four_workers_to_two_keeps_the_loss_within_1e_3(run, fault_free_run):
    reference = fault_free_run(STEPS, *FOUR)
    proc, run_dir = run(
        "shrink-4-2",
        *FOUR,
        "ft.spares=0",
        "fault=two_kills",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_worker,rank:2,step:{FAULT_STEP}}}]",
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = read_summary(run_dir)
    assert summary["final_world_size"] == 2 and summary["steps"] == STEPS
    assert summary["final_loss"] == pytest.approx(read_summary(reference)["final_loss"], rel=1e-3)


def test_with_on_no_spare_wait_the_job_waits_for_a_replacement(run, fault_free):
    proc, run_dir = run(
        "wait", *TWO, "ft.spares=0", "ft.on_no_spare=wait", "fault=kill_worker", f"fault.step={FAULT_STEP}"
    )
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free(TWO), failures=1)
    assert summary["final_world_size"] == 2
    events = read_events(run_dir / "events")
    assert not any(e["event"] == "job_shrunk" for e in events)
    assert any(e["event"] == "spare_promoted" for e in events)


def attempts_of(run_dir) -> set[int]:
    return {e["attempt"] for e in with_attempts(read_events(run_dir / "events")) if e["event"] == "worker_start"}


def test_checkpoint_restart_baseline_restarts_every_worker_from_the_last_checkpoint(run, fault_free, tmp_path):
    """torchrun restarts the whole group after a kill; the workers reload the checkpoint of step 10 and redo step
    11 before the interrupted step 12: the same bits in the end, and the report reads the restart from the events."""
    proc, run_dir = run(
        "restart-kill",
        *TWO,
        "ft=checkpoint_restart",
        "fault=kill_worker",
        f"fault.step={FAULT_STEP}",
        "ft.checkpoint_every=5",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == fault_free(TWO)
    assert attempts_of(run_dir) == {0, 1}  # every worker was started a second time
    (failure,) = summary["failures"]
    assert failure["detected_by"] == "torchrun" and failure["step"] == FAULT_STEP
    (recovery,) = summary["recoveries"]
    assert recovery["completed"] and recovery["loaded_step"] == 10 and recovery["redone_steps"] == 1
    assert recovery["time_to_recover_s"] > recovery["rebuild_s"] > 0
    assert "goodput" in proc.stdout and "torchrun restarted every worker" in proc.stdout

    report = subprocess.run(
        [sys.executable, "-m", "launcher.report", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr
    assert "time lost per failure" in report.stdout
    assert json.loads((run_dir / "goodput.json").read_text())["failures"] == 1
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_restart_with_auto_interval_recovers_an_exception(run, fault_free):
    """`checkpoint_every=auto` writes a first checkpoint to measure its cost, then fixes the Young-Daly interval
    (here longer than the run, so the restart after the exception goes back to step 0)."""
    proc, run_dir = run(
        "restart-exception", *TWO, "ft=checkpoint_restart", "fault=exception", f"fault.step={FAULT_STEP}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == fault_free(TWO)
    schedule = json.loads((run_dir / "checkpoints" / "schedule.json").read_text())
    assert schedule["every_steps"] > STEPS and schedule["write_s"] > 0
    (recovery,) = summary["recoveries"]
    # The exception lands in the step in progress when the signal arrives (FAULT_STEP, or the next one).
    assert recovery["loaded_step"] == 0 and recovery["interrupted_step"] >= FAULT_STEP
    assert recovery["redone_steps"] == recovery["interrupted_step"] - 1


def coordinator_events(run_dir) -> dict[str, list[dict]]:
    events = read_events(run_dir / "events")
    kinds = ("coordinator_lost", "coordinator_restarted", "coordinator_resumed", "agent_resent", "fault_injected")
    return {kind: [e for e in events if e["event"] == kind] for kind in kinds}


def test_a_killed_coordinator_is_restarted_from_its_journal_and_no_step_is_lost(run, fault_free):
    proc, run_dir = run("kill-coordinator", *TWO, "fault=kill_coordinator", f"fault.step={FAULT_STEP}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["param_sha256"] == fault_free(TWO)
    assert summary["failures"] == [] and summary["recoveries"] == []  # the workers never noticed
    events = coordinator_events(run_dir)
    assert [e["exit_code"] for e in events["coordinator_lost"]] == [-9]
    assert len(events["coordinator_restarted"]) == len(events["coordinator_resumed"]) == 1
    assert events["agent_resent"][0]["workers"] == ["worker0", "worker1", "worker2"]
    (restart,) = summary["coordinator_restarts"]
    assert restart["completed"] and "SIGKILL" in restart["detail"]
    # The new coordinator took over the same port: the workers' store and the agent's channel came back there.
    started = [e for e in read_events(run_dir / "events") if e["event"] == "coordinator_started"]
    assert started[0]["pid"] != events["coordinator_resumed"][0]["pid"]
    assert "coordinator restarted" in proc.stdout


def test_a_worker_killed_while_the_coordinator_is_down_is_replaced_once_it_is_back(run, fault_free):
    # Both strike at once; the worker's kill is delivered first, then the coordinator dies before hearing of it.
    proc, run_dir = run(
        "kill-while-down",
        *TWO,
        "fault=kill_worker",
        "fault.rank=1",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_coordinator,step:{FAULT_STEP}}}]",
    )
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free(TWO), failures=1)
    assert summary["failures"][0]["rank"] == 1
    events = coordinator_events(run_dir)
    (resumed,) = events["coordinator_resumed"]
    (detected,) = [e for e in read_events(run_dir / "events") if e["event"] == "failure_detected"]
    assert detected["t"] > resumed["t"]  # seen by the restarted coordinator, from what the agent kept


def test_a_coordinator_killed_in_the_middle_of_a_recovery(run, fault_free):
    proc, run_dir = run(
        "coordinator-in-recovery",
        *TWO,
        "fault=kill_worker",
        "fault.rank=1",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_coordinator,where:recovery,step:{FAULT_STEP}}}]",
    )
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free(TWO), failures=1)
    assert len(summary["coordinator_restarts"]) == 1
    killed = next(e for e in coordinator_events(run_dir)["fault_injected"] if e["kind"] == "kill_coordinator")
    assert killed["generation"] == 2  # it died with generation 2 forming
    # Whichever way the forming generation went (formed on the new store, or published again under a new number
    # because its rendezvous keys died with the old store), the recovery completes once.
    assert [r["completed"] for r in summary["recoveries"]] == [True]


SHARDED = (*FOUR, "parallel.shard=2")
"""Two replica groups of two shards (HSDP): ranks 0 and 2 hold shard 0 of the state, ranks 1 and 3 shard 1."""


def test_a_killed_sharded_worker_gets_its_slice_from_the_same_shard_of_the_other_group(run, fault_free):
    proc, run_dir = run("sharded-kill", *SHARDED, "fault=kill_worker", "fault.rank=1", f"fault.step={FAULT_STEP}")
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free(SHARDED), failures=1)
    recovery = summary["recoveries"][0]
    assert recovery["source_ranks"] == [3]  # the only other holder of shard 1; survivors keep their own slices
    transfers = [e for e in read_events(run_dir / "events") if e.get("phase") == "transfer"]
    assert {e["rank"]: e["bytes_moved"] > 0 for e in transfers} == {0: False, 1: False, 2: False, 3: True}
    assert all(e["receivers"] == [1] for e in transfers)
    rebuilds = [e for e in read_events(run_dir / "events") if e.get("phase") == "rebuild"]
    assert all(e["reshard_s"] > 0 for e in rebuilds)  # each rank re-sharded its model over the new group


def test_a_slice_without_a_live_copy_falls_back_to_the_disk_checkpoint_bitwise(run, fault_free):
    # Ranks 1 and 3 hold the only copies of shard 1: both killed at once, every rank loads its own slices of the
    # newest checkpoint (each of the four wrote its own; verified against the sums of the whole state).
    proc, run_dir = run(
        "sharded-fallback",
        *SHARDED,
        "ft.spares=2",
        "ft.checkpoint_every=5",
        "fault=kill_worker",
        "fault.rank=1",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_worker,rank:3,step:{FAULT_STEP}}}]",
    )
    assert_recovered(proc, run_dir, expected_hash=fault_free(SHARDED), failures=2)
    fallbacks = [e for e in read_events(run_dir / "events") if e["event"] == "checkpoint_fallback"]
    assert sorted(e["rank"] for e in fallbacks) == [0, 1, 2, 3] and all(e["step"] == 10 for e in fallbacks)


def test_a_sharded_checkpoint_loads_bitwise_into_other_layouts(run):
    """Written by 2 x 2 ranks (two replica groups of two shards), loaded by one group of two shards and by two
    full replicas: each load is checked against the sums of the whole state and gives the same parameters."""
    proc, written = run("sharded-checkpoint", *SHARDED, "ft.spares=0", f"ft.checkpoint_every={STEPS}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [p.name for p in (written / "checkpoints").glob("step_*")] == [f"step_{STEPS:08d}"]
    expected = read_summary(written)["param_sha256"]
    read = {}
    for shard in (2, 1):
        proc, resumed = run(
            f"resumed-shard{shard}", *TWO, f"parallel.shard={shard}", "ft.spares=0", f"resume={written}"
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        loaded = [e for e in read_events(resumed / "events") if e["event"] == "checkpoint_loaded"]
        assert len(loaded) == 2 and all(e["step"] == STEPS for e in loaded)
        assert read_summary(resumed)["param_sha256"] == expected
        read[shard] = max(e["bytes"] for e in loaded)
    assert read[2] < 0.6 * read[1]  # a sharded rank reads its own slices, never the whole state


def test_a_sharded_job_without_a_spare_shrinks_to_the_whole_replica_group_left(run, fault_free_run):
    proc, run_dir = run(
        "sharded-shrink", *SHARDED, "ft.spares=0", "fault=kill_worker", "fault.rank=1", f"fault.step={FAULT_STEP}"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == STEPS and summary["final_world_size"] == 2
    shrunk = next(e for e in read_events(run_dir / "events") if e["event"] == "job_shrunk")
    assert shrunk["demoted"] == ["worker2"]  # worker3 holds shard 1 and stays, as rank 1
    reference = fault_free_run(STEPS, *SHARDED)
    assert summary["final_loss"] == pytest.approx(read_summary(reference)["final_loss"], rel=1e-3)


def test_a_corrupted_slice_is_caught_against_its_own_copy_and_repaired_from_it(run):
    # Two copies of each slice: a mismatch cannot tell which is right; the lower rank's copy wins (docs/sharding.md
    # says so), so corrupting rank 3 (shard 1 of group 1) makes it the outlier, repaired from rank 1.
    proc, run_dir = run(
        "sharded-corrupt", *SHARDED, "ft.check_every=2", "fault=corrupt", "fault.rank=3", f"fault.step={FAULT_STEP}"
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert read_summary(run_dir)["status"] == "completed"
    divergence = [e for e in read_events(run_dir / "events") if e["event"] == "divergence_detected"]
    assert divergence and all(e["outlier_ranks"] == [3] and e["resolution"] == "lowest_rank" for e in divergence)
    transfers = [e for e in read_events(run_dir / "events") if e.get("phase") == "transfer" and e["bytes_moved"]]
    assert transfers and {(e["rank"], tuple(e["receivers"])) for e in transfers} == {(1, (3,))}


def test_two_copies_that_differ_roll_the_job_back_to_the_disk_checkpoint_bitwise(run, fault_free):
    # Rank 1 corrupted: the lowest-rank rule would keep its copy. With a checkpoint on disk every rank loads its
    # slices of it instead, the steps since are redone, and the run ends with the bits of a run without the fault.
    # Checked every 4 steps and at each checkpoint's step (5, 10, 15): none is written of unchecked state.
    proc, run_dir = run(
        "sharded-rollback",
        *SHARDED,
        "ft.check_every=4",
        "ft.checkpoint_every=5",
        "fault=corrupt",
        "fault.rank=1",
        f"fault.step={FAULT_STEP}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["param_sha256"] == fault_free(SHARDED)
    events = read_events(run_dir / "events")
    divergence = [e for e in events if e["event"] == "divergence_detected"]
    assert divergence and all(e["outlier_ranks"] == [3] and e["resolution"] == "checkpoint" for e in divergence)
    fallbacks = [e for e in events if e["event"] == "checkpoint_fallback"]
    assert sorted(e["rank"] for e in fallbacks) == [0, 1, 2, 3] and all(e["step"] == 10 for e in fallbacks)


def test_with_compiled_blocks_a_killed_worker_recovers_bitwise(run, fault_free):
    """`trainer.compile`: the spare compiles while it warms up; the run equals the fault-free compiled run."""
    compiled = (*TWO, "trainer.compile=true")
    proc, run_dir = run("compiled-kill", *compiled, "fault=kill_worker", "fault.rank=1", f"fault.step={FAULT_STEP}")
    assert_recovered(proc, run_dir, expected_hash=fault_free(compiled), failures=1)


EVAL = ("eval.every=4", "eval.samples=64")
"""Validation every 4 steps on 64 held-out samples: long enough that a kill in the step after an evaluation step
lands in its evaluation as often as not."""


def test_validation_losses_after_a_recovery_are_bitwise_those_of_the_fault_free_run(run, fault_free_run):
    """Rank 0 killed in the step after an evaluation step (its evaluation runs first thing in that step): the
    evaluation is redone after the recovery, and every validation loss, the final parameters and every metrics line
    are those of the fault-free run. Rank 0 writes the metrics: its spare completes the line rank 0 held."""
    proc, run_dir = run("eval-kill", *TWO, *EVAL, "fault=kill_worker", "fault.rank=0", "fault.step=13")
    reference = fault_free_run(STEPS, *TWO, *EVAL)
    assert_recovered(proc, run_dir, expected_hash=read_summary(reference)["param_sha256"], failures=1)
    metrics, expected = read_metrics(run_dir), read_metrics(reference)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    validation = {m["step"]: m["val_loss"] for m in metrics if "val_loss" in m}
    assert validation == {m["step"]: m["val_loss"] for m in expected if "val_loss" in m}
    assert sorted(validation) == [4, 8, 12, 16, 20, 24]
    assert [m["loss"] for m in metrics] == [m["loss"] for m in expected]
    assert "val_loss" in proc.stdout
    redone = [e for e in read_events(run_dir / "events") if e["event"] == "evaluated" and e["step"] == 12]
    assert len({e["worker"] for e in redone}) >= 2  # the survivor's, and the spare's after the recovery
