"""How a replica's memory budget is split at start-up, decided before anything is allocated.

    budget = weights (base + every layer at its starting precision) + reserve + KV (committed blocks)

The KV address space is reserved for the most blocks the budget could ever hold (every layer at the
ladder's lowest rung); only `capacity` blocks are committed at start. When the full-precision model
leaves no room for one max_model_len request, layers start at the lowest rung, in swap order, until
it does (`fit_budget`): the replica starts morphed instead of refusing to start.

Pure arithmetic over byte counts: the engine builder (engine/engine_builder.py) gathers the facts.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.errors import BudgetError
from engine.model import Transformer, layer_bias_names, linear_shapes
from engine.model_config import ModelConfig
from engine.precision import Precision
from engine.quant import quantized_nbytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How the budget is split at start-up."""
    budget: int
    weights: int
    reserve: int
    block_bytes: int
    capacity: int  # committed KV blocks now
    max_blocks: int  # KV blocks if every layer sat at the lowest rung (address space to reserve)
    min_blocks: int  # blocks one max_model_len request needs


@dataclasses.dataclass(frozen=True)
class MemoryFacts:
    """What the plan depends on, besides each layer's bytes."""
    budget: int
    reserve: int
    base_weights: int  # embeddings, final norm, lm head
    block_bytes: int  # one KV block across all layers (k and v)
    min_blocks: int
    lowest_layer_bytes: int | None  # one layer at the ladder's lowest rung; None when morphing is off


def plan_memory(budget: int, weights: int, lowest_weights: int, reserve: int, block_bytes: int,
                min_blocks: int) -> MemoryPlan:
    """Split the budget; BudgetError (with the minimum budget) when one full-length request cannot fit."""
    capacity = max(0, (budget - weights - reserve) // block_bytes)
    if capacity < min_blocks:
        minimum = weights + reserve + min_blocks * block_bytes
        raise BudgetError(
            f"memory budget {budget} bytes ({budget / 2**20:.1f} MiB) is too small: weights {weights} + "
            f"reserve {reserve} + KV for one max_model_len request ({min_blocks} blocks x {block_bytes}) "
            f"need at least {minimum} bytes ({minimum / 2**20:.1f} MiB). Raise memory_budget to at least "
            f"{-(-minimum // 2**20)}MiB, or lower max_model_len / max_num_batched_tokens.")
    max_blocks = max(capacity, (budget - lowest_weights - reserve) // block_bytes)
    return MemoryPlan(budget, weights, reserve, block_bytes, capacity, max_blocks, min_blocks)


def memory_facts(config: EngineConfig, mc: ModelConfig, model: Transformer, max_model_len: int) -> MemoryFacts:
    elem = torch.empty((), dtype=config.torch_dtype).element_size()
    # Default reserve: one step's activations at the token budget (hidden, MLP and logits rows), and the
    # INT4 AMX kernel's per-thread scratch (transient like activations, so it is counted with them).
    reserve = config.reserve if config.reserve is not None else (
        config.max_num_batched_tokens * (mc.hidden_size + mc.intermediate_size + mc.vocab_size) * elem
        + int4_scratch_bytes(config, mc, torch.get_num_threads()))
    block_bytes = mc.num_layers * 2 * config.block_size * mc.num_kv_heads * mc.head_dim * elem
    return MemoryFacts(budget=config.memory_budget_bytes, reserve=int(reserve), base_weights=model.base_weight_bytes(),
                       block_bytes=block_bytes, min_blocks=-(-max_model_len // config.block_size),
                       lowest_layer_bytes=lowest_layer_bytes(config, mc) if config.enable_morphing else None)


AMX_BLOCK_N, AMX_CHUNK_M = 64, 128  # engine/kernels/int4_amx.cpp: kBlockN, kChunkM


def int4_scratch_bytes(config: EngineConfig, mc: ModelConfig, threads: int) -> int:
    """What the INT4 AMX op allocates per call while it runs, on every thread: a bf16 [K, 64] dequantized
    column block and an fp32 [128, 64] accumulator (0 when INT4 is not on the ladder). The AVX512-BF16 op
    (int4_avx512.cpp) needs the same block and, in place of the accumulator, [K/G, 64] fp32 scales and
    offsets per thread (at most as large for G >= 32), plus [rows, K/G] fp32 group sums per call, which
    the reserve's activation rows cover many times over. The AVX2 op (int4_avx2.cpp) needs less: an fp32
    [512, 32] chunk and [K/G, 32] scales per thread."""
    if Precision.INT4 not in config.ladder or not config.enable_morphing:
        return 0
    k = max(mc.hidden_size, mc.intermediate_size)
    return threads * (k * AMX_BLOCK_N * 2 + AMX_CHUNK_M * AMX_BLOCK_N * 4)


def lowest_layer_bytes(config: EngineConfig, mc: ModelConfig) -> int:
    """One layer's linears at the ladder's lowest rung (sizes known before quantizing)."""
    lowest = config.ladder[-1]
    biased = layer_bias_names(mc, 0)
    return sum(quantized_nbytes(lowest, out_f, in_f, config.int4_group_size,
                                bias_dtype=config.torch_dtype if name in biased else None)
               for name, (out_f, in_f) in linear_shapes(mc).items())


def plan_for(facts: MemoryFacts, layer_bytes: Sequence[int]) -> MemoryPlan:
    """The plan with each layer holding `layer_bytes[i]`."""
    weights = facts.base_weights + sum(layer_bytes)
    lowest = weights if facts.lowest_layer_bytes is None else (
        facts.base_weights + len(layer_bytes) * facts.lowest_layer_bytes)
    return plan_memory(facts.budget, weights, lowest, facts.reserve, facts.block_bytes, facts.min_blocks)


def fit_budget(facts: MemoryFacts, full_bytes: Sequence[int], low_bytes: Sequence[int], order: Sequence[int],
               low_name: str = "the lowest rung") -> tuple[int, MemoryPlan]:
    """(k, plan): the fewest layers, taken in swap order and held at `low_bytes`, that make one
    max_model_len request fit (k = 0: the full-precision model fits). BudgetError when not even all do."""
    try:
        return 0, plan_for(facts, full_bytes)
    except BudgetError as e:
        last = e
    current = list(full_bytes)
    for count, layer in enumerate(order, start=1):
        current[layer] = low_bytes[layer]
        try:
            return count, plan_for(facts, current)
        except BudgetError as e:
            last = e
    raise BudgetError(f"even with every layer at {low_name}: {last}") from None
