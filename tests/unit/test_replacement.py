"""The supervisor's replacement policy: promote ready spares, else fail, wait or shrink (ft.on_no_spare)."""

from __future__ import annotations

import pytest

from ckptless_core.layout import Layout
from ckptless_core.replacement import Replacement, grow, largest_size, replace_lost

FOUR = {"w0": 0, "w1": 1, "w2": 2, "w3": 3}


def any_size(at_most: int) -> int:
    return at_most


def powers_of_two(at_most: int) -> int:
    """As when the global batch only divides by 1, 2 and 4 ranks."""
    return max((size for size in (1, 2, 4) if size <= at_most), default=0)


@pytest.mark.parametrize("policy", ["shrink", "wait", "fail"])
def test_ready_spares_take_the_lost_ranks_lowest_first_whatever_the_policy(policy):
    plan = replace_lost(FOUR, ["w3", "w1"], ["s0", "s1", "s2"], on_no_spare=policy, largest_size=any_size)
    assert plan == Replacement({"w0": 0, "w2": 2, "s0": 1, "s1": 3}, promoted={"s0": 1, "s1": 3})


def test_without_enough_spares_fail_ends_the_job_naming_the_ranks():
    plan = replace_lost(FOUR, ["w1", "w2"], ["s0"], on_no_spare="fail", largest_size=any_size)
    assert plan.promoted == {"s0": 1} and plan.vacant == [2]
    assert "rank(s) [2]" in plan.abandon and "ft.on_no_spare=fail" in plan.abandon


def test_without_enough_spares_wait_holds_the_job_for_the_vacant_ranks():
    plan = replace_lost(FOUR, ["w2"], [], on_no_spare="wait", largest_size=any_size)
    assert plan.wait and plan.vacant == [2] and not plan.abandon
    assert plan.members == {"w0": 0, "w1": 1, "w3": 3}


def test_shrink_keeps_the_lowest_ranks_at_the_largest_size_the_job_can_run_at():
    # Three survivors, but the batch divides only by 1, 2 or 4 ranks: ranks 0 and 1 go on, w3 waits as a spare.
    plan = replace_lost(FOUR, ["w2"], [], on_no_spare="shrink", largest_size=powers_of_two)
    assert plan.members == {"w0": 0, "w1": 1}
    assert (plan.shrunk_to, plan.vacant, plan.demoted) == (2, [2], ["w3"])
    # A promoted spare counts as a survivor at its new rank.
    plan = replace_lost(FOUR, ["w0", "w2"], ["s0"], on_no_spare="shrink", largest_size=powers_of_two)
    assert plan.members == {"s0": 0, "w1": 1} and plan.demoted == ["w3"]


def test_shrink_ends_the_job_when_no_size_is_left():
    plan = replace_lost({"w0": 0, "w1": 1}, ["w0"], [], on_no_spare="shrink", largest_size=lambda at_most: 0)
    assert plan.abandon and plan.vacant == [0]


def test_a_sharded_shrink_keeps_every_survivor_on_the_slice_it_holds():
    # 2 replica groups x 2 shards; rank 1 (group 0, shard 1) lost without a spare: one group is left, and its
    # shard 1 is rank 3's slice (w3), not w2's, which holds shard 0 like w0.
    layout = Layout(shard=2)
    plan = replace_lost(FOUR, ["w1"], [], on_no_spare="shrink", largest_size=any_size, layout=layout)
    assert plan.members == {"w0": 0, "w3": 1} and plan.shrunk_to == 2 and plan.demoted == ["w2"]
    assert all(layout.shard_index(FOUR[name]) == layout.shard_index(rank) for name, rank in plan.members.items())


def test_a_sharded_shrink_with_a_slice_lost_everywhere_ends_the_job():
    plan = replace_lost(FOUR, ["w1", "w3"], [], on_no_spare="shrink", largest_size=any_size, layout=Layout(shard=2))
    assert plan.abandon and plan.vacant == [1, 3]


def test_the_largest_size_keeps_whole_replica_groups_and_sizes_the_global_batch_allows():
    assert largest_size(7) == 7
    assert largest_size(7, layout=Layout(2)) == 6
    assert largest_size(7, layout=Layout(2), world_sizes=(1, 2, 4, 8)) == 4
    assert largest_size(1, layout=Layout(2)) == 0  # not one whole group: the job cannot run


def test_a_shrunken_job_grows_back_as_far_as_ready_spares_and_the_sizes_allow():
    two = {"w0": 0, "w1": 1}
    assert grow(two, ["s0"], nproc=4, largest_size=powers_of_two) is None  # 3 is not a size the batch allows
    assert grow(two, ["s0", "s1", "s2"], nproc=4, largest_size=powers_of_two) == {"w0": 0, "w1": 1, "s0": 2, "s1": 3}
    assert grow(FOUR, ["s0"], nproc=4, largest_size=any_size) is None  # whole already
