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


def test_the_default_reserve_counts_the_int4_kernels_scratch_on_every_thread():
    from engine.config import EngineConfig
    from engine.memory_plan import int4_scratch_bytes
    from engine.model_config import ModelConfig

    mc = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=64, tie_word_embeddings=True)
    config = EngineConfig(model="default")
    per_thread = 128 * 64 * 2 + 128 * 64 * 4  # bf16 [K=128, 64] block + fp32 [128, 64] accumulator
    assert int4_scratch_bytes(config, mc, threads=3) == 3 * per_thread
    assert int4_scratch_bytes(config.model_copy(update={"morph_ladder": ("int8",)}), mc, threads=3) == 0
