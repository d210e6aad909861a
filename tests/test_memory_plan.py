"""engine/memory_plan.py: the start-up split of the budget and how many layers must start low, as
exact arithmetic (no model)."""
from __future__ import annotations

import pytest

from engine.errors import BudgetError
from engine.memory_plan import MemoryFacts, fit_budget, plan_for

# base 100 bytes, 4 layers of 50 (10 at the lowest rung), reserve 40, blocks of 10, one request = 3 blocks
FACTS = MemoryFacts(budget=400, reserve=40, base_weights=100, block_bytes=10, min_blocks=3, lowest_layer_bytes=10)
FULL, LOW = [50, 50, 50, 50], [10, 10, 10, 10]


def test_the_plan_commits_what_the_budget_leaves_and_reserves_for_the_lowest_rung():
    plan = plan_for(FACTS, FULL)
    assert (plan.weights, plan.capacity, plan.max_blocks, plan.min_blocks) == (300, 6, 22, 3)
    off = plan_for(MemoryFacts(**{**FACTS.__dict__, "lowest_layer_bytes": None}), FULL)
    assert off.max_blocks == off.capacity == 6  # no morphing: nothing beyond the committed blocks


def test_layers_start_low_in_swap_order_until_one_request_fits():
    assert fit_budget(FACTS, FULL, LOW, [3, 1, 0, 2])[0] == 0
    tight = MemoryFacts(**{**FACTS.__dict__, "budget": 300})  # full model: 300 + 40 > 300
    count, plan = fit_budget(tight, FULL, LOW, [3, 1, 0, 2])
    assert count == 2 and plan.weights == 100 + 50 + 50 + 10 + 10  # layers 3 and 1 low
    assert (plan.capacity, plan.max_blocks) == ((300 - 220 - 40) // 10, (300 - 140 - 40) // 10)
    with pytest.raises(BudgetError, match="even with every layer at int4"):
        fit_budget(MemoryFacts(**{**FACTS.__dict__, "budget": 200}), FULL, LOW, [0, 1, 2, 3], "int4")
