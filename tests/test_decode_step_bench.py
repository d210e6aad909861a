"""ops/bench/decode_step.py on a tiny model: decode batches and (--prefill) first prefill chunks, with
layers switched to INT4 and back, report one median per configuration (the benchmark's plumbing,
not its timings)."""
from __future__ import annotations

import json

import pytest
import torch

from engine.layers.packed import PackedLinear, packing_available, vnni_op
from engine.loader import load_model
from engine.morph.profiler import LayerSwitch
from engine.precision import Precision
from engine.quant.awq import LayerWeights, quantize_layer_rtn
from ops.bench import decode_step, lm_head
from tests.conftest import make_tiny_hf_model


def test_prefill_chunk_covers_its_tokens_with_whole_blocks():
    step = decode_step.prefill_chunk(37, vocab=100)
    (chunk,) = step.chunks
    assert len(chunk.token_ids) == 37 and chunk.start_pos == 0
    assert len(chunk.block_table) == -(-37 // decode_step.BLOCK_SIZE)


def test_decode_batch_block_layouts_give_each_request_its_own_blocks():
    batch, context = 3, 40
    per_seq = -(-(context + 1) // decode_step.BLOCK_SIZE)
    for layout in decode_step.BLOCK_LAYOUTS:
        tables = [c.block_table for c in decode_step.decode_batch(batch, context, 100, layout).chunks]
        assert all(len(t) == per_seq for t in tables)
        assert sorted(b for t in tables for b in t) == list(range(batch * per_seq))  # the runner's storage
    interleaved = [c.block_table for c in decode_step.decode_batch(batch, context, 100, "interleaved").chunks]
    assert interleaved[1] == tuple(j * batch + 1 for j in range(per_seq))


def test_bench_times_prefill_chunks_and_restores_the_layers(tiny_model_dir):
    model = load_model(str(tiny_model_dir), torch.float32, "cpu").model
    n = model.config.num_layers
    before = [layer.get_linears()["q_proj"].precision for layer in model.layers]
    switch = LayerSwitch(model, {i: quantize_layer_rtn(LayerWeights.of_layer(model.layers[i]), Precision.INT4)
                                 for i in range(n)})
    out = decode_step.bench(model, {"int4": switch}, list(range(n)), [0, n], [5, 20], context=0, rounds=1,
                            steps=1, prefill=True)
    assert set(out) == {"prefill=5", "prefill=20"}
    assert all(set(row) == {"int4=0", f"int4={n}"} and all(v > 0 for v in row.values()) for row in out.values())
    assert [layer.get_linears()["q_proj"].precision for layer in model.layers] == before
    json.dumps(out)  # the report is plain JSON


def test_dispatch_settings_resolve_auto_like_the_engine():
    from engine.quant.int4_kernel import resolve_int4_min_rows

    settings = dict(decode_step.dispatch_settings(["auto", "never", "8"], ["on"]))
    assert settings == {" amx=auto": {"int4_min_rows": resolve_int4_min_rows("auto"), "int4_avx2": True},
                        " amx=never": {"int4_min_rows": None, "int4_avx2": True},
                        " amx=8": {"int4_min_rows": 8, "int4_avx2": True}}


def test_lm_head_bench_compares_both_heads_and_leaves_the_packed_one(tmp_path):
    """ops/bench/lm_head.py on a tiny tied model in bf16, where the head packs in place."""
    if not (packing_available(torch.bfloat16, "cpu") and vnni_op() is not None):
        pytest.skip("lm_head packs in place only in the vnni32 layout (bf16 with native bf16, kernels built)")
    model = load_model(str(make_tiny_hf_model(tmp_path / "m", tie_word_embeddings=True)), torch.bfloat16, "cpu").model
    results = lm_head.bench(model, [1, 2], context=20, rounds=2, steps=1, layout="interleaved")
    assert set(results) == {"batch=1", "batch=2"}
    assert all(len(r["round_ratios"]) == 2 and min(r["packed_ms"], r["plain_ms"], r["packed_logits_ms"], r["plain_logits_ms"]) > 0
               for r in results.values())
    assert "compute_logits" not in vars(model)  # the clock unwrapped it
    assert isinstance(model.lm_head, PackedLinear) and model.embed_weight is None  # the engine's form again
