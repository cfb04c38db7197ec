"""Who takes a failed worker's rank: the coordinator's policy as a pure function of the membership, the lost workers
and the ready spares, so that every case can be read, and tested, without processes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ckptless_core.layout import FULL_REPLICAS, Layout


@dataclass(frozen=True)
class Replacement:
    members: dict[str, int]
    """The next generation (worker -> rank); with `wait`, still missing the ranks in `vacant`."""
    promoted: dict[str, int] = field(default_factory=dict)
    """Ready spares given a failed rank (worker -> rank)."""
    vacant: list[int] = field(default_factory=list)
    """Failed ranks that no ready spare could take."""
    shrunk_to: int = 0
    """World size after a shrink (0: no shrink)."""
    demoted: list[str] = field(default_factory=list)
    """Survivors beyond the shrunken world size: they wait as spares (their state goes stale)."""
    wait: bool = False
    """`ft.on_no_spare=wait`: fill `vacant` with spares yet to start before the next generation begins."""
    abandon: str = ""
    """Why the job cannot go on (empty: it can)."""


def replace_lost(
    members: dict[str, int],
    lost: list[str],
    ready_spares: list[str],
    *,
    on_no_spare: str,
    largest_size: Callable[[int], int],
    layout: Layout = FULL_REPLICAS,
) -> Replacement:
    """Ready spares take the lost workers' ranks, lowest rank first. If spares run short, `on_no_spare` decides:
    `fail` ends the job, `wait` holds it for new spares, `shrink` keeps whole replica groups at the largest world
    size the job can run at (`largest_size(at_most)`, 0: none, which ends the job too): every survivor kept holds
    the same slice of the state as before (`Layout.keep_slices`; with full replicas, the lowest ranks)."""
    members = dict(members)
    vacant = sorted(members.pop(name) for name in lost)
    promoted = dict(zip(ready_spares, vacant, strict=False))
    members.update(promoted)
    vacant = vacant[len(promoted) :]
    if not vacant:
        return Replacement(members, promoted)
    holders = [sum(layout.shard_index(r) == index for r in members.values()) for index in range(layout.shard)]
    size = largest_size(min(holders) * layout.shard)
    if on_no_spare == "fail" or (on_no_spare == "shrink" and not size):
        reason = f"no spare left to replace rank(s) {vacant} (ft.on_no_spare={on_no_spare})"
        return Replacement(members, promoted, vacant, abandon=reason)
    if on_no_spare == "wait":
        return Replacement(members, promoted, vacant, wait=True)
    kept = layout.keep_slices(members, size // layout.shard)
    demoted = [name for name, _ in sorted(members.items(), key=lambda kv: kv[1]) if name not in kept]
    return Replacement(kept, promoted, vacant, shrunk_to=size, demoted=demoted)
