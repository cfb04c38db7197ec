"""The coordinator's replacement policy: who takes a failed worker's rank (a ready spare, or nobody: then the job
shrinks, waits or ends), the world sizes a job can run at, and when a shrunken job grows back. Pure functions of the
membership, the lost workers and the ready spares, so that every case can be read, and tested, without processes."""

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


def largest_size(at_most: int, *, layout: Layout = FULL_REPLICAS, world_sizes: tuple[int, ...] = ()) -> int:
    """The largest world size up to `at_most` that the job can run at (0: none): whole replica groups of `layout`,
    and one of `world_sizes` where the global batch allows only those (empty: any)."""
    sizes = (size for size in range(1, at_most + 1) if layout.can_run_at(size))
    return max((size for size in sizes if not world_sizes or size in world_sizes), default=0)


def grow(
    members: dict[str, int], ready_spares: list[str], *, nproc: int, largest_size: Callable[[int], int]
) -> dict[str, int] | None:
    """A shrunken job takes ready spares back (a planned generation change): the next generation's members, at the
    largest size the spares allow up to `nproc`, new ranks after the kept ones; None when it cannot grow."""
    world_size = len(members)
    if world_size >= nproc:
        return None
    size = largest_size(min(nproc, world_size + len(ready_spares)))
    if size <= world_size:
        return None
    grown = dict(members)
    for spare in ready_spares[: size - world_size]:
        grown[spare] = len(grown)
    return grown
