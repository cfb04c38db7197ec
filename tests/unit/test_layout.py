"""Where each slice of the state lives: the one function of the layout that transfer, checks and shrink ask."""

from __future__ import annotations

import pytest

from ckptless_core.layout import FULL_REPLICAS, Layout


def test_with_full_replicas_every_other_rank_holds_a_copy():
    assert FULL_REPLICAS.copies_of(1, 4) == [0, 2, 3]
    assert FULL_REPLICAS.mesh_shape(4) == (4, 1)


def test_a_sharded_rank_is_copied_by_the_same_shard_index_in_the_other_replica_groups():
    layout = Layout(shard=2)  # ranks 0 1 | 2 3 | 4 5
    assert [layout.shard_index(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert layout.copies_of(1, 6) == [3, 5] and layout.copies_of(4, 6) == [0, 2]
    assert layout.copies_of(0, 2) == []  # one replica group: no copy
    assert layout.mesh_shape(6) == (3, 2)


def test_only_whole_replica_groups_can_run():
    layout = Layout(shard=4)
    assert [w for w in range(1, 13) if layout.can_run_at(w)] == [4, 8, 12]
    with pytest.raises(ValueError, match="whole replica groups"):
        layout.mesh_shape(6)
    with pytest.raises(ValueError, match="at least one rank"):
        Layout(shard=0)


def test_keeping_slices_renumbers_group_by_group_without_moving_a_slice():
    layout = Layout(shard=2)
    members = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 5}  # rank 4 lost: shard 0 has holders 0, 2; shard 1: 1, 3, 5
    assert layout.keep_slices(members, 2) == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert layout.keep_slices(members, 1) == {"a": 0, "b": 1}
