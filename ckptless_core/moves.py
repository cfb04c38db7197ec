"""Planned moves: a host that is leaving (SIGTERM to its agent alone, or `python -m launcher drain`), or a straggler
(`stragglers`), hands its ranks to ready spares on hosts that stay, at a step boundary, with nothing lost and nothing
replayed.

The coordinator publishes the next generation with `after_step` (the boundary: two steps past the most advanced
report, as a clean stop picks it, so no member has passed it) and the leaving members as `departing`: every member
trains on until it has committed that step, then each departing worker sends its state to the spare that takes its
rank (`transfer.hand_over`: they are healthy, so nothing is detected or replayed) and exits. Without a ready spare,
`ft.on_no_spare` decides as after a failure: `shrink` (at the same boundary, keeping a copy of every slice), `wait`
(the host keeps training for up to `ft.drain_grace_s` while spares start elsewhere; then a shrink), `fail` (the job
stops cleanly). A move that leaves no copy of some slice, or no host to train on, stops the job cleanly too. A move
is not a failure: its events are `move_started` and the workers' `handed_over`, never `failure_detected`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ckptless_core.layout import Layout
from ckptless_core.protocol import Generation, new_store_prefix
from ckptless_core.replacement import replace_lost

if TYPE_CHECKING:
    from ckptless_core.coordinator import Coordinator
    from ckptless_core.membership import HostRecord


def start_drains(coordinator: Coordinator) -> None:
    """Plan the move of every leaving host that is due (one per look, and never while a generation forms)."""
    membership = coordinator.membership
    if coordinator.stop_requested or membership.recovering():
        return
    now = time.monotonic()
    for host in sorted(membership.hosts.values(), key=lambda record: record.name):
        if host.leaving and not host.handed_over and now >= host.leaving_at:
            _drain(coordinator, host, now=now)
            return


def _drain(coordinator: Coordinator, host: HostRecord, *, now: float) -> None:
    membership, ft = coordinator.membership, coordinator.ft
    generation = membership.generation
    departing = sorted(
        (n for n in generation.members if membership.workers[n].host == host.name), key=generation.members.get
    )
    on_no_spare = ft.on_no_spare
    if departing and on_no_spare == "wait" and len(_staying_spares(membership)) < len(departing):
        if now - host.leaving_at < ft.drain_grace_s:
            _start_spares(coordinator, len(departing))
            return
        on_no_spare = "shrink"  # waited `ft.drain_grace_s`
    host.handed_over = True
    if not departing:  # a host of spares: they go with it, and spares owed start elsewhere
        return
    if not move_ranks(coordinator, departing, reason="drain", host=host.name, on_no_spare=on_no_spare):
        coordinator.request_stop()


def move_ranks(coordinator: Coordinator, departing: list[str], *, reason: str, host: str, on_no_spare: str) -> bool:
    """Publish the move of `departing`'s ranks to ready spares on hosts that stay, at a step boundary; without
    enough of them `on_no_spare` decides (`shrink`, `fail`; '': move nothing, and wait). False: the job cannot go on
    without these workers (its stop reason says why)."""
    membership, ft = coordinator.membership, coordinator.ft
    generation = membership.generation
    spares = _staying_spares(membership)
    if not on_no_spare and len(spares) < len(departing):
        return True
    layout = Layout(ft.shard)
    plan = replace_lost(
        generation.members,
        departing,
        spares,
        on_no_spare=on_no_spare or "fail",
        largest_size=coordinator._largest_size,
        layout=layout,
    )
    if plan.abandon:
        reason = f"host {host} is leaving and {plan.abandon.replace('replace', 'take')}: the job stops cleanly"
        coordinator.stop_reason = reason
        coordinator.events.emit("move_refused", host=host, reason=reason)
        return False
    for name in departing:
        membership.retire(name)
        membership.workers[name].departing = True
    membership.spares_owed += len(plan.promoted)
    after_step = max(membership.progress().values(), default=0) + 2
    number = generation.number + 1
    coordinator.events.emit(
        "move_started",
        reason=reason,
        host=host,
        generation=number,
        after_step=after_step,
        moved={name: _taker(plan.promoted, generation.members[name]) for name in departing},
        shrunk_to=plan.shrunk_to,
    )
    coordinator._publish(
        Generation(
            number=number,
            members=plan.members,
            reason=reason,
            store_prefix=new_store_prefix(number),
            after_step=after_step,
            departing={name: generation.members[name] for name in departing},
        )
    )
    return True


def _staying_spares(membership) -> list[str]:
    """Ready spares on hosts that are not leaving."""
    return [s for s in membership.ready_spares() if _stays(membership, s)]


def watch_departures(coordinator: Coordinator) -> None:
    """A departing worker that died before it handed its state over (its move's generation still forming): the
    spare that takes its rank waits for it in vain, so the generation is published again at once, without a
    boundary (a recovery: the state comes from the copies that stay, or the newest disk checkpoint)."""
    membership = coordinator.membership
    generation = membership.generation
    if not generation.after_step or not membership.recovering():
        return
    lost = [n for n in generation.departing if membership.workers[n].exit_code not in (None, 0)]
    if lost:
        coordinator.events.emit("handover_lost", workers=lost, generation=generation.number)
        members = dict(generation.members)
        coordinator._publish_next(members, reason="failure")


def _start_spares(coordinator: Coordinator, wanted: int) -> None:
    """`ft.on_no_spare=wait`: spares (ready or starting) on hosts that stay, `wanted` of them at least."""
    membership = coordinator.membership
    spares = [s for s in membership.spares() if _stays(membership, s)]
    for _ in range(wanted - len(spares)):
        if (host := membership.spare_host()) is None:
            return
        coordinator._start_worker(host, spare=True)


def _stays(membership, worker: str) -> bool:
    host = membership.hosts.get(membership.workers[worker].host)
    return host is not None and not host.leaving


def _taker(promoted: dict[str, int], rank: int) -> str | None:
    """The spare that takes `rank` (None: nobody, the job shrinks)."""
    return next((spare for spare, taken in promoted.items() if taken == rank), None)
