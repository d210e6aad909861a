"""Everything an LLMEngine runs with, built in order before the engine object exists:

    model + tokenizer (engine/loader.py) -> [pack_lm_head: packed lm_head copy, where the runner cannot pack it in place]
      -> memory facts -> [morphing: host store, swap order, layers that start low] -> memory plan
      -> ledger, KV storage, block pool, block tables -> scheduler, pressure monitor
      -> KV resizer -> model runner (packs the layers) -> [morphing: packed store, morph executor]

No part reaches back into the engine, and the engine never builds a part itself (nano-vllm style:
its runner, scheduler and cache arrive built).
"""
from __future__ import annotations

import dataclasses

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.kv_cache_manager import KVCacheManager
from engine.kv_storage import KVStorage
from engine.layers.packed import packing_available
from engine.ledger import MemoryLedger
from engine.loader import load_model
from engine.memory_plan import MemoryPlan, memory_facts, plan_for
from engine.model import Transformer
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.monitor import PressureMonitor
from engine.morph.executor import MorphExecutor
from engine.morph.kv_resizer import KVResizer
from engine.morph.packed_store import ensure_packed_store
from engine.morph.setup import prepare_morphing
from engine.precision import Precision, full_precision_for
from engine.quant.dispatch import AmxDispatch, set_amx_dispatch
from engine.quant.int4_kernel import resolve_int4_min_rows
from engine.quant.int8 import resolve_int8_min_rows
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclasses.dataclass(frozen=True)
class EngineParts:
    config: EngineConfig
    model_name: str
    model_config: ModelConfig
    max_model_len: int
    tokenizer: Tokenizer | None
    model: Transformer
    full_precision: Precision
    eos_token_ids: frozenset[int]
    memory_plan: MemoryPlan
    ledger: MemoryLedger
    storage: KVStorage
    pool: BlockPool
    kv_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    monitor: PressureMonitor
    kv_resizer: KVResizer
    morph_executor: MorphExecutor | None  # None: morphing disabled


def build_engine_parts(config: EngineConfig) -> EngineParts:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    # process-wide, like the thread count (quant/dispatch.py)
    set_amx_dispatch(AmxDispatch(int4_min_rows=resolve_int4_min_rows(config.int4_amx_min_rows),
                                 int8_min_rows=resolve_int8_min_rows(config.int8_amx_min_rows)))
    loaded = load_model(config.model, config.torch_dtype, config.device, config.cache_path)
    mc, model = loaded.config, loaded.model
    if config.pack_lm_head and packing_available(model.dtype, config.device):  # before the plan: its bytes count
        model.pack_head_copy()
    max_model_len = _max_model_len(config, mc)
    facts = memory_facts(config, mc, model, max_model_len)
    # Morphing first: its host store and starting precisions decide the plan.
    morph = prepare_morphing(config, loaded, facts) if config.enable_morphing else None
    plan = morph.plan if morph else plan_for(facts, [model.layer_weight_bytes(i) for i in range(mc.num_layers)])

    ledger = MemoryLedger(plan.budget, plan.reserve)
    ledger.set_base_weights(model.base_weight_bytes())
    for i in range(mc.num_layers):
        ledger.set_layer_weights(i, model.layer_weight_bytes(i))
    ledger.set_kv(plan.capacity * plan.block_bytes)
    pool = BlockPool(plan.capacity, plan.max_blocks)
    storage = KVStorage(mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, config.torch_dtype,
                        torch.device(config.device), plan.max_blocks, plan.capacity)
    kv_manager = KVCacheManager(pool, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(kv_manager, config.max_num_batched_tokens, config.max_num_seqs)
    kv_resizer = KVResizer(pool, storage, kv_manager, ledger, min_blocks=plan.min_blocks)
    runner = ModelRunner(model, storage, torch.device(config.device))  # packs the model's layers where it pays
    executor = MorphExecutor(model, ledger, kv_resizer, pool, morph.host_store, morph.swap_order, morph.ladder,
                             forced_quantized=morph.start_low,
                             packed_store=ensure_packed_store(morph.host_store) if runner.device.type == "cpu" else None
                             ) if morph else None
    tokenizer = loaded.tokenizer
    eos = frozenset(mc.eos_token_ids) | frozenset(tokenizer.eos_token_ids if tokenizer is not None else ())
    return EngineParts(
        config=config, model_name=config.served_model_name or loaded.files.name, model_config=mc,
        max_model_len=max_model_len, tokenizer=tokenizer, model=model,
        full_precision=full_precision_for(config.torch_dtype), eos_token_ids=eos, memory_plan=plan, ledger=ledger,
        storage=storage, pool=pool, kv_manager=kv_manager, scheduler=scheduler,
        runner=runner,
        monitor=PressureMonitor(scheduler, pool, ledger, reservation_tokens=config.output_reservation_tokens),
        kv_resizer=kv_resizer, morph_executor=executor)


def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    if config.max_model_len is None:
        return min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
    if config.max_model_len > mc.max_position_embeddings:
        raise ModelLoadError(f"max_model_len={config.max_model_len} exceeds the model's context of "
                             f"{mc.max_position_embeddings} tokens; lower max_model_len")
    return config.max_model_len
