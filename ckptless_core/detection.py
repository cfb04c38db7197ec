"""Failure detection: the rules by which the coordinator finds a member failed, from its records alone
(`membership.py`), on its own clock.

Four ways, in the order they are asked:
1. **Exits.** A worker that exited (its agent saw it at once), or went with its host (the agent's channel closed or
   fell silent for `ft.host_timeout_s`).
2. **Silence.** A live worker that sent nothing for `ft.heartbeat_timeout_s` hangs (a stopped process): it is fenced.
   Until its first message it is starting, bounded by the start timeout instead.
3. **Stalls.** A step in which some rank has waited `ft.stall_timeout_s` inside the collective for ranks that do not
   arrive blames those ranks (`protocol.blame_stalled`), never the ranks waiting: they are fenced.
4. **Reports.** A worker that reported an error it survived, once `ft.settle_s` passed (a process failure that
   explains it shows up first); a collective that failed because a peer raised is that peer's failure.

Two more rules end the job instead: a training-code error raised again after a replay (a bug), and no step committed
for `ft.progress_deadline_s` (whatever hang no rule blames).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckptless_core.job import WORKER_EXIT_TRAINING_CODE_ERROR, FaultToleranceSpec, describe_exit
from ckptless_core.membership import Membership
from ckptless_core.protocol import blame_stalled


@dataclass(frozen=True)
class Failure:
    """A member found failed, as `failure_detected` records it."""

    kind: str
    """`exit`, `host_lost`, `start`, `hang`, `stuck`, or what the worker reported (`collective`, `exception`)."""
    detail: str
    detected_by: str
    """Which rule found it: `process_exit`, `host_timeout`, `start_timeout`, `heartbeat`, `progress`,
    `worker_report`."""
    lost: bool = True
    """The worker is gone (else it reported, and rejoins the next generation)."""
    last_seen: float = 0.0
    """The last sign of life the coordinator had of what failed (its clock): the host's last message for a lost
    host, the last message for a hung worker, the exit for an exit, the last progress marker for a stuck rank, the
    report for a report. The time lost to the failure counts from here, not from when a rule found it."""

    def event_fields(self) -> dict[str, str]:
        return {"kind": self.kind, "detail": self.detail, "detected_by": self.detected_by}


def find_failures(
    membership: Membership,
    ft: FaultToleranceSpec,
    *,
    now: float,
    start_timeout_s: float,
    fence: Callable[[str], None],
) -> dict[str, Failure]:
    """Members of the current generation that exited, went silent or stalled a step (each fenced through `fence`
    before it is returned), or reported an error; keyed by worker. Without fault tolerance, exits alone."""
    members = membership.generation.members
    codes = membership.exit_codes(members)
    failures: dict[str, Failure] = {}
    for name, code in codes.items():
        worker = membership.workers[name]
        if worker.lost_with_host:
            failures[name] = Failure(
                "host_lost", worker.lost_with_host, "host_timeout", last_seen=worker.host_last_heard
            )
        elif code not in (None, 0):
            failures[name] = Failure("exit", describe_exit(code), "process_exit", last_seen=worker.last_heard)
    if not ft.enabled:
        return failures
    alive = [n for n in members if codes.get(n) is None and n not in failures]
    for name in alive:
        worker = membership.workers[name]
        if not worker.pid or not worker.spoke:
            # Not forked yet (its agent's fork server may still be importing), or forked and still starting (its
            # imports, its model: minutes on a loaded machine, not a hang): bounded by the start timeout.
            if now - worker.started_at > start_timeout_s:
                detail = f"not started within {start_timeout_s:.0f} s (cluster.start_timeout_s)"
                if worker.pid:
                    fence(name)
                failures[name] = Failure("start", detail, "start_timeout", last_seen=worker.started_at)
            continue
        heard_at = max(worker.last_heard, worker.started_at)
        silent_s = now - heard_at
        if silent_s > ft.heartbeat_timeout_s:
            fence(name)
            failures[name] = Failure("hang", f"no heartbeat for {silent_s:.1f} s", "heartbeat", last_seen=heard_at)
    if failures:
        return failures
    for name in stalled_members(membership, now=now, stall_timeout_s=ft.stall_timeout_s):
        fence(name)
        position = membership.workers[name].position
        step = position.step + 1 if position else "?"
        detail = f"alive but did not arrive at the collective of step {step}"
        failures[name] = Failure("stuck", detail, "progress", last_seen=position.received_at if position else now)
    if failures:
        return failures
    reports = {
        name: membership.workers[name].failure[0]
        for name in alive
        if membership.workers[name].failure is not None
        and membership.workers[name].failure[0].generation == membership.generation.number
    }
    if not any(now - membership.workers[name].failure[1] >= ft.settle_s for name in reports):
        return failures
    # A collective that failed because a peer raised and left it is that peer's failure, not a second one.
    causes = {name: r for name, r in reports.items() if r.kind != "collective"} or reports
    for name, report in causes.items():
        reported_at = membership.workers[name].failure[1]
        failures[name] = Failure(report.kind, report.error, "worker_report", lost=False, last_seen=reported_at)
    return failures


def stalled_members(membership: Membership, *, now: float, stall_timeout_s: float) -> list[str]:
    """Members blamed for a stalled step (see `protocol.blame_stalled`), from this generation's markers."""
    generation = membership.generation
    positions = {
        name: membership.workers[name].position
        for name in generation.members
        if membership.workers[name].position is not None
        and membership.workers[name].position_generation == generation.number
    }
    if len(positions) < generation.world_size:
        return []  # the generation is still forming
    return blame_stalled(positions, now=now, stall_timeout_s=stall_timeout_s)


def training_code_culprit(membership: Membership) -> str | None:
    """A member whose training code raised the same error again after a replay (its exit code says so, or its
    report), if any: a bug, not a failure."""
    codes = membership.exit_codes(membership.generation.members)
    culprits = [n for n, code in codes.items() if code == WORKER_EXIT_TRAINING_CODE_ERROR]
    culprits += [n for n in codes if bug_report(membership, n) is not None]
    return culprits[0] if culprits else None


def bug_report(membership: Membership, name: str):
    """The `bug` report `name` sent, if it sent one."""
    failure = membership.workers[name].failure
    return failure[0] if failure is not None and failure[0].kind == "bug" else None


def missed_progress_deadline(membership: Membership, *, now: float, deadline_s: float) -> list[int] | None:
    """The ranks that did not arrive at the collective, once no step was committed for `deadline_s` in a formed
    generation (counted from the last commit, or from when the last member became active); None before."""
    generation = membership.generation
    members = [membership.workers[name] for name in generation.members]
    if any(w.position_generation != generation.number for w in members):
        return None  # still forming: bounded by the start and recovery timeouts
    step, at = membership.last_commit
    since = max(at, *(w.active_since for w in members))
    if now - since <= deadline_s:
        return None
    return sorted(
        generation.members[name]
        for name in generation.members
        if (position := membership.workers[name].position) is None
        or position.marker not in ("collective_entered", "collective_waiting")
        or position.step < step
    )
