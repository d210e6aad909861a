"""The pure sizing rules of admission-time morphing and demand restores (engine/morph/sizing.py):
exact layer counts from block and byte figures."""
from __future__ import annotations

import pytest

from engine.morph.sizing import growth_blocks, loss_blocks, plan_admission, plan_restore

BLOCK = 1000


def test_growth_is_cumulative_whole_blocks_within_the_reserved_room():
    # 2,500 bytes per layer: 2, 5, 7, 10 blocks after 1..4 layers (the half blocks add up)
    assert growth_blocks(0, BLOCK, 100, [2500] * 4) == (0, 2, 5, 7, 10)
    assert growth_blocks(600, BLOCK, 100, [2500] * 2) == (0, 3, 5)  # bytes already free count
    assert growth_blocks(0, BLOCK, 6, [2500] * 4) == (0, 2, 5, 6, 6)  # address space ends at 6 more
    assert growth_blocks(-50, BLOCK, 9, [1000]) == (0, 1)


def test_loss_counts_the_blocks_a_restore_must_give_back():
    assert loss_blocks(0, BLOCK, [2500] * 3) == (0, 3, 5, 8)
    assert loss_blocks(1200, BLOCK, [2500] * 2) == (0, 2, 4)


def test_admission_sizes_the_swap_to_the_whole_queue_deficit():
    growth = growth_blocks(0, BLOCK, 1000, [10_000] * 6)  # 10 blocks per layer, 6 allowed
    # head 12 blocks, 5 available: deficit of the queue (12 + 8 + 9 = 29) - 5 = 24 -> 3 layers, not 1
    plan = plan_admission([12, 8, 9], 5, growth)
    assert (plan.layers, plan.admits, plan.deficit_blocks, plan.capped) == (3, 3, 24, False)
    # exactly on a layer boundary: deficit 20 -> 2 layers
    assert plan_admission([12, 13], 5, growth).layers == 2
    # the head fits and the next step could only start it: no swap
    assert plan_admission([5, 40], 5, growth).layers == 0
    # ... but when the next step could start both, both must fit: 45 - 5 = 40 -> 4 layers
    assert plan_admission([5, 40], 5, growth, admissible_now=2).layers == 4


def test_admission_under_the_cap_takes_the_longest_prefix_that_fits():
    growth = growth_blocks(0, BLOCK, 1000, [10_000] * 2)  # only 2 layers allowed: 20 blocks
    plan = plan_admission([10, 10, 10], 0, growth)
    assert (plan.layers, plan.admits, plan.capped) == (2, 2, True)
    plan = plan_admission([10, 5, 30], 0, growth)  # 10 + 5 = 15 -> 2 layers; the 30 cannot follow
    assert (plan.layers, plan.admits, plan.deficit_blocks, plan.capped) == (2, 2, 15, True)
    # not even the head fits with every allowed layer: swapping buys nothing
    plan = plan_admission([25], 0, growth)
    assert (plan.layers, plan.admits, plan.capped, plan.head_blocked) == (0, 0, True, True)
    assert plan_admission([], 0, growth).layers == 0


def test_restore_gives_back_what_the_demand_leaves_room_for_below_the_usage_bound():
    loss = loss_blocks(0, BLOCK, [10_000] * 4)  # 10 blocks per restored layer
    assert plan_restore(needed_blocks=24, capacity_blocks=80, loss=loss, max_usage=0.6) == 4  # 24 <= 0.6 x 40
    assert plan_restore(needed_blocks=25, capacity_blocks=80, loss=loss, max_usage=0.6) == 3  # 25 <= 0.6 x 50
    assert plan_restore(needed_blocks=49, capacity_blocks=80, loss=loss, max_usage=0.6) == 0  # 0.6 x 70 = 42
    assert plan_restore(needed_blocks=0, capacity_blocks=80, loss=loss, max_usage=0.6) == 4
    with pytest.raises(ValueError):
        plan_restore(1, 2, loss, 0.0)
