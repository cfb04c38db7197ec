"""The coordinator's rules, read from its records alone: which member failed and how it was found (`detection`),
and who is in the job after what the agents relayed (`membership`). No processes: reports are fed as the agents'
channels would deliver them, on a clock the test sets."""

from __future__ import annotations

import pytest

from ckptless_core.detection import (
    Failure,
    find_failures,
    missed_progress_deadline,
    stalled_members,
    training_code_culprit,
)
from ckptless_core.events import EventLog, read_jsonl
from ckptless_core.job import WORKER_EXIT_TRAINING_CODE_ERROR, FaultToleranceSpec
from ckptless_core.journal import Journal, read_journal
from ckptless_core.membership import HostRecord, Membership
from ckptless_core.protocol import FailureReport, Generation, Heartbeat, Progress, Ready, WorkerExited, WorkerStarted
from ckptless_core.stragglers import find_straggler

FT = FaultToleranceSpec(enabled=True, heartbeat_timeout_s=10.0, stall_timeout_s=10.0, settle_s=0.3)


@pytest.fixture
def job(tmp_path):
    """Two hosts, four members (worker0..3, ranks 0..3, all started at t=0 and heard at t=0), one spare on host b."""
    membership = Membership(
        journal=Journal(tmp_path / "journal.jsonl"), events=EventLog(tmp_path / "events.jsonl", worker="c"), num_hosts=2
    )
    for host in ("a", "b"):
        membership.hosts[host] = HostRecord(name=host, channel=None, last_heard=0.0)
    members = {membership.add_worker("a" if rank < 2 else "b", spare=False): rank for rank in range(4)}
    membership.add_worker("b", spare=True)
    membership.set_generation(Generation(number=1, members=members, store_prefix="x/gen1"))
    for name, worker in membership.workers.items():
        membership.record(worker.host, WorkerStarted(worker=name, pid=100, spare=worker.spare), 0.0)
        membership.record(worker.host, Heartbeat(worker=name, generation=0), 0.0)
    yield membership
    membership.journal.close()
    membership.events.close()


def relay(membership: Membership, message, at: float) -> None:
    membership.record(membership.workers[message.worker].host, message, at)


def mark(membership: Membership, worker: str, step: int, marker: str, at: float, generation: int = 1) -> None:
    relay(membership, Progress(worker=worker, generation=generation, step=step, marker=marker), at)


def detect(membership: Membership, now: float, ft: FaultToleranceSpec = FT) -> tuple[dict[str, Failure], list[str]]:
    fenced: list[str] = []
    failures = find_failures(membership, ft, now=now, start_timeout_s=300.0, fence=fenced.append)
    return failures, fenced


def test_nothing_fails_while_every_member_is_heard(job):
    for name in job.generation.members:
        relay(job, Heartbeat(worker=name, generation=1), 5.0)
    assert detect(job, now=12.0) == ({}, [])


def test_an_exit_is_a_lost_failure_found_by_its_exit_code_and_not_fenced(job):
    relay(job, WorkerExited(worker="worker1", exit_code=-9), 1.0)
    failures, fenced = detect(job, now=1.0)
    assert failures == {"worker1": Failure("exit", "killed by SIGKILL", "process_exit", last_seen=1.0)}
    assert fenced == []


def test_a_worker_gone_with_its_host_is_blamed_on_the_host(job):
    job.lose_host("b", "silent for 2.0 s", last_heard=0.5)
    failures, _ = detect(job, now=2.5)
    assert set(failures) == {"worker2", "worker3"}
    assert failures["worker2"].kind == "host_lost" and failures["worker2"].detected_by == "host_timeout"
    assert failures["worker2"].last_seen == 0.5  # timed from the host's last message, not from its detection
    assert "b" in job.lost_hosts and job.spares() == []  # the spare went with it
    assert {"op": "host_lost", "name": "b"} in read_journal(job.journal.path)


def test_a_silent_worker_is_fenced_then_reported_as_hung(job):
    for name in ("worker0", "worker1", "worker3"):
        relay(job, Heartbeat(worker=name, generation=1), 9.0)
    failures, fenced = detect(job, now=10.5)
    assert fenced == ["worker2"]
    assert failures == {"worker2": Failure("hang", "no heartbeat for 10.5 s", "heartbeat", last_seen=0.0)}


def test_a_worker_not_heard_from_since_its_fork_is_starting_and_bounded_by_the_start_timeout(tmp_path):
    """Its imports and its model take minutes on a loaded machine: that is not a hang."""
    membership = Membership(
        journal=Journal(tmp_path / "journal.jsonl"), events=EventLog(tmp_path / "events.jsonl", worker="c"), num_hosts=1
    )
    membership.hosts["a"] = HostRecord(name="a", channel=None, last_heard=0.0)
    name = membership.add_worker("a", spare=False)
    membership.set_generation(Generation(number=1, members={name: 0}, store_prefix="x/gen1"))
    membership.record("a", WorkerStarted(worker=name, pid=100, spare=False), 0.0)
    assert detect(membership, now=250.0) == ({}, [])
    failures, fenced = detect(membership, now=301.0)
    assert failures[name].detected_by == "start_timeout" and fenced == [name]


def test_without_fault_tolerance_only_exits_count(job):
    relay(job, WorkerExited(worker="worker0", exit_code=1), 1.0)
    failures, fenced = detect(job, now=100.0, ft=FaultToleranceSpec(enabled=False))
    assert set(failures) == {"worker0"} and fenced == []


def stall(job, *, at: float) -> None:
    """Ranks 0, 1 and 3 wait in step 5's collective since t=1 (renewing their marker at `at`); rank 2 computes."""
    for name in ("worker0", "worker1", "worker3"):
        mark(job, name, 4, "collective_entered", 1.0)
        mark(job, name, 4, "collective_waiting", at)
    mark(job, "worker2", 4, "step_entered", 1.0)
    relay(job, Heartbeat(worker="worker2", generation=1), at)


def test_a_stalled_step_blames_the_rank_that_never_arrived_never_the_waiting_ones(job):
    stall(job, at=10.5)
    assert stalled_members(job, now=10.0, stall_timeout_s=10.0) == []  # waited 9 s: not yet
    failures, fenced = detect(job, now=11.5)
    assert fenced == ["worker2"]
    detail = "alive but did not arrive at the collective of step 5"
    assert failures == {"worker2": Failure("stuck", detail, "progress", last_seen=1.0)}  # its last progress marker


def test_no_stall_is_judged_while_the_generation_still_forms(job):
    stall(job, at=10.5)
    job.set_generation(Generation(number=2, members=job.generation.members, store_prefix="y/gen2"))
    assert stalled_members(job, now=30.0, stall_timeout_s=10.0) == []


def test_a_report_waits_for_the_settle_time_and_a_peers_error_outranks_the_collectives_it_broke(job):
    relay(job, FailureReport(worker="worker0", generation=1, step=3, kind="collective", error="reset"), 1.0)
    relay(job, FailureReport(worker="worker1", generation=1, step=3, kind="exception", error="boom"), 1.0)
    for name in job.generation.members:
        relay(job, Heartbeat(worker=name, generation=1), 1.1)
    assert detect(job, now=1.2) == ({}, [])  # within ft.settle_s: an exit may still explain it
    failures, fenced = detect(job, now=1.4)
    assert failures == {"worker1": Failure("exception", "boom", "worker_report", lost=False, last_seen=1.0)}
    assert fenced == []


def test_a_report_of_an_older_generation_is_not_a_failure_of_this_one(job):
    relay(job, FailureReport(worker="worker1", generation=0, step=3, kind="exception", error="old"), 1.0)
    for name in job.generation.members:
        relay(job, Heartbeat(worker=name, generation=1), 2.0)
    assert detect(job, now=2.0) == ({}, [])


def test_a_bug_is_named_by_its_exit_code_or_its_report(job):
    assert training_code_culprit(job) is None
    relay(job, WorkerExited(worker="worker3", exit_code=WORKER_EXIT_TRAINING_CODE_ERROR), 1.0)
    assert training_code_culprit(job) == "worker3"
    relay(job, FailureReport(worker="worker1", generation=1, step=3, kind="bug", error="Traceback"), 1.0)
    assert training_code_culprit(job) == "worker3"  # an exit code outranks a report


def test_the_progress_deadline_names_the_ranks_that_did_not_arrive(job):
    for name in job.generation.members:
        mark(job, name, 6, "committed", 1.0)
    for name in ("worker0", "worker1", "worker2"):
        mark(job, name, 6, "collective_entered", 2.0)
    mark(job, "worker3", 6, "step_entered", 2.0)
    assert missed_progress_deadline(job, now=600.0, deadline_s=600.0) is None
    assert missed_progress_deadline(job, now=602.0, deadline_s=600.0) == [3]


def test_reports_of_a_retired_or_foreign_worker_change_nothing_and_are_recorded_as_refused(job):
    job.retire("worker1")
    relay(job, Ready(worker="worker1"), 1.0)
    job.record("a", Ready(worker="worker2"), 1.0)  # worker2 lives on host b
    assert not job.workers["worker1"].ready and not job.workers["worker2"].ready
    job.events.close()
    refused = [e for e in read_jsonl(job.events.path) if e["event"] == "report_refused"]
    assert [(e["worker_name"], e["host"]) for e in refused] == [("worker1", "a"), ("worker2", "a")]


def test_a_restarted_coordinator_rebuilds_the_same_membership_from_the_journal(job, tmp_path):
    job.spares_owed = 1
    job.retire("worker3")
    replayed = Membership(journal=job.journal, events=job.events, num_hosts=2)
    for record in read_journal(job.journal.path):
        replayed.replay(record)
    assert replayed.generation == job.generation
    assert {n: (w.host, w.spare, w.retired) for n, w in replayed.workers.items()} == {
        n: (w.host, w.spare, w.retired) for n, w in job.workers.items()
    }
    assert replayed.spares_owed == 1 and replayed.next_worker_id == 5


def commit(membership: Membership, worker: str, step: int, compute_s: float) -> None:
    relay(membership, Progress(worker=worker, generation=1, step=step, marker="committed", compute_s=compute_s), 1.0)


def test_a_straggler_is_slower_than_the_others_median_on_every_step_of_the_window(job):
    for step in range(1, 21):
        for name in ("worker0", "worker1", "worker3"):
            commit(job, name, step, 1.0 + 0.1 * (step % 3))  # the healthy ones vary from step to step
        commit(job, "worker2", step, 2.0 if step > 10 else 1.0)
    assert find_straggler(job, factor=1.5, window=10) == ("worker2", pytest.approx(2.0 / 1.1))
    assert find_straggler(job, factor=1.5, window=11) is None  # slow for 10 steps only
    assert find_straggler(job, factor=2.0, window=10) is None  # not that slow


def test_a_machine_slowing_every_rank_alike_or_a_step_missing_makes_no_straggler(job):
    for step in range(1, 21):
        for name in ("worker0", "worker1", "worker2", "worker3"):
            commit(job, name, step, 1.0 if step <= 10 else 3.0)  # every rank 3x slower from step 11
    assert find_straggler(job, factor=1.5, window=10) is None
    for step in range(21, 31):
        for name in ("worker0", "worker1", "worker3"):  # worker2 reports nothing (sharded: not measured)
            commit(job, name, step, 1.0)
    assert find_straggler(job, factor=1.5, window=10) is None
