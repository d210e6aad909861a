"""Morphing's parts, made before the engine exists: the host store, the swap order, and the layers
that must start at the lowest rung for the budget to hold one max_model_len request.

Errors surface here, at start-up: a host store that cannot be built or read, a calibration source
that cannot be had, a profile that does not fit the model (ModelLoadError); a budget that not even
the all-lowest model fits (BudgetError, with the minimum).
"""
from __future__ import annotations

import dataclasses
import logging

from engine.config import EngineConfig
from engine.loader import LoadedModel
from engine.memory_plan import MemoryFacts, MemoryPlan, fit_budget
from engine.morph.host_store import HostStore
from engine.morph.layer_swapper import build_linears
from engine.morph.store_builder import ensure_host_store, store_spec_for
from engine.morph.swap_order import SwapOrder, prepared_profile_path, resolve_swap_order
from engine.precision import Precision, full_precision_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MorphSetup:
    host_store: HostStore
    swap_order: SwapOrder
    ladder: tuple[Precision, ...]  # full first, e.g. (BF16, INT8, INT4)
    start_low: int  # the first `start_low` layers of the swap order start at the lowest rung
    plan: MemoryPlan  # the memory plan with those layers low


def prepare_morphing(config: EngineConfig, loaded: LoadedModel, facts: MemoryFacts) -> MorphSetup:
    """Build or open the host store, resolve the swap order, and put the layers that must start low
    at the lowest rung (the model is not yet anyone else's: no ledger counts it yet)."""
    model, name, n = loaded.model, loaded.files.name, loaded.config.num_layers
    ladder = (full_precision_for(config.torch_dtype), *config.ladder)
    store = ensure_host_store(model, store_spec_for(config, name, loaded.files.hf_dir), config.cache_path,
                              loaded.tokenizer)
    order = resolve_swap_order(n, name, config.profile, prepared_profile_path(config.cache_path, name))
    lowest = ladder[-1]
    full_bytes = [model.layer_weight_bytes(i) for i in range(n)]
    count, plan = fit_budget(facts, full_bytes, [store.layer_bytes(i, lowest) for i in range(n)], order.order,
                             lowest.value)
    if count:
        logger.warning("memory budget too small for the full-precision model; starting with %d layers at %s",
                       count, lowest.value)
    device = model.device
    for layer in order.order[:count]:
        model.layers[layer].set_weights(*build_linears(store.read(layer, lowest, device), device))
    return MorphSetup(store, order, ladder, count, plan)
