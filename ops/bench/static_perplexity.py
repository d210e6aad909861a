"""WikiText-2 perplexity of the two static modes (all layers bf16; all layers INT4), by reusing
ops/quality/perplexity.py on a small fixed token budget (the second half of WikiText-2's validation
split; AWQ calibrated as the host store does: its default text and windows)."""
from __future__ import annotations

import torch


def static_perplexities(model: str, tokens: int, window: int, threads: int) -> dict[str, float]:
    from engine import datasets
    from engine.loader import load_model
    from engine.morph.calibration import as_batch, calibration_text, token_windows
    from engine.morph.profiler import LayerSwitch
    from engine.morph.store_builder import StoreSpec
    from engine.precision import parse_dtype
    from ops.quality.perplexity import perplexity, perplexity_with, quantized_variants

    torch.set_num_threads(threads)
    loaded = load_model(model, parse_dtype("bf16"))
    net, tokenizer = loaded.model, loaded.tokenizer
    eval_ids = tokenizer.encode(datasets.text_half(datasets.resolve("wikitext2"), "second"))[:tokens]
    store = StoreSpec  # its class attributes are the host store's defaults
    text = calibration_text(store.calibration)
    calib = as_batch(token_windows(tokenizer, text.text, store.calibration_seqs, store.calibration_len))
    _, int4 = quantized_variants(net, calib, "awq")
    every = list(range(net.config.num_layers))
    return {"morphserve-static-fp": perplexity(net, eval_ids, window),
            "morphserve-static-int4": perplexity_with(net, LayerSwitch(net, int4), every, eval_ids, window)}
