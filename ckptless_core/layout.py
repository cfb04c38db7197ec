"""Where each rank's training state lives: `shard` ranks hold one copy of the state between them, in shard index
order, and every group of `shard` consecutive ranks is a replica group (HSDP: replicate x shard).

    rank = replica_group * shard + shard_index

Rank r's state is its shard index's slice of the parameters and optimizer state; the ranks that hold a copy of it
are those with the same shard index in the other replica groups. Full replicas are the case `shard=1` (every rank
holds a copy of every other's state). Transfer, the replica checks and the shrink policy all ask `copies_of`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    shard: int = 1
    """Ranks one copy of the state is sharded over (FSDP inside a replica group)."""

    def __post_init__(self) -> None:
        if self.shard < 1:
            raise ValueError(f"a layout needs at least one rank per copy of the state, not shard={self.shard}")

    def shard_index(self, rank: int) -> int:
        """Which slice of the state rank `rank` holds."""
        return rank % self.shard

    def copies_of(self, rank: int, world_size: int) -> list[int]:
        """The other ranks that hold the same slice of the state as `rank` in a job of `world_size` ranks."""
        return [r for r in range(world_size) if r != rank and self.shard_index(r) == self.shard_index(rank)]

    def can_run_at(self, world_size: int) -> bool:
        """Whether `world_size` ranks form whole replica groups."""
        return world_size >= self.shard and world_size % self.shard == 0

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(replica groups, shard) of a job of `world_size` ranks."""
        if not self.can_run_at(world_size):
            raise ValueError(f"{world_size} ranks do not form whole replica groups of {self.shard}")
        return world_size // self.shard, self.shard

    def keep_slices(self, members: dict[str, int], groups: int) -> dict[str, int]:
        """A shrink to `groups` replica groups that keeps every member's slice: for each shard index, its
        lowest-ranked holders, renumbered group by group. Members not kept are left out."""
        kept: dict[str, int] = {}
        for index in range(self.shard):
            holders = sorted((rank, name) for name, rank in members.items() if self.shard_index(rank) == index)
            for group, (_, name) in enumerate(holders[:groups]):
                kept[name] = group * self.shard + index
        return dict(sorted(kept.items(), key=lambda item: item[1]))


FULL_REPLICAS = Layout()
"""Every rank holds all of the state (plain data parallelism)."""
