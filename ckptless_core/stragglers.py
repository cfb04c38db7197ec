"""Stragglers: a rank that is persistently slower than the others (a throttled GPU, a bad NIC, a noisy neighbour)
fails nothing, but the whole job runs at its speed. The coordinator finds it from what every member reports with
each committed step: its compute before the step's first collective (`Progress.compute_s`; the others wait in that
collective for the slowest). A member whose compute exceeds `ft.straggler_factor` times the median of the others'
on each of the last `ft.straggler_window_steps` steps that every member reported is a straggler; a rank slowed for
fewer steps, or a machine slowing every rank alike, is not.

`ft.on_straggler=replace` moves its rank to a ready spare at a step boundary, as a drain does (`moves`), and only
reports it while no spare is ready; `report` reports it (event `straggler_detected`); `off` looks at nothing.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ckptless_core.membership import Membership
from ckptless_core.moves import move_ranks

if TYPE_CHECKING:
    from ckptless_core.coordinator import Coordinator


def find_straggler(membership: Membership, *, factor: float, window: int) -> tuple[str, float] | None:
    """(the straggling member, its median ratio to the others over the window), or None."""
    members = list(membership.generation.members)
    if len(members) < 2:
        return None
    times = {name: membership.workers[name].compute_s for name in members}
    steps = sorted(set.intersection(*(set(t) for t in times.values())))[-window:]
    if len(steps) < window:
        return None
    for name in members:
        ratios = [times[name][s] / statistics.median(times[o][s] for o in members if o != name) for s in steps]
        if min(ratios) > factor:
            return name, statistics.median(ratios)
    return None


def watch_stragglers(coordinator: Coordinator) -> None:
    """One look: report a new straggler, and under `replace` move its rank once a spare is ready."""
    membership, ft = coordinator.membership, coordinator.ft
    if ft.on_straggler == "off" or coordinator.stop_requested or membership.recovering():
        return
    found = find_straggler(membership, factor=ft.straggler_factor, window=ft.straggler_window_steps)
    if found is None:
        return
    name, ratio = found
    if name not in coordinator.stragglers:
        coordinator.stragglers.add(name)
        coordinator.events.emit(
            "straggler_detected",
            worker_name=name,
            rank=membership.generation.members[name],
            host=membership.workers[name].host,
            ratio=ratio,
            window_steps=ft.straggler_window_steps,
            action=ft.on_straggler,
        )
    if ft.on_straggler == "replace":
        move_ranks(coordinator, [name], reason="straggler", host=membership.workers[name].host, on_no_spare="")
