"""WikiText-2 perplexity of the two static modes (all layers bf16; all layers INT4), by reusing
ops/quality/perplexity.py on a small fixed token budget (the second half of the shared WikiText-2
validation file; AWQ calibrated on the first half, as the host store does)."""
from __future__ import annotations

import torch


def static_perplexities(model: str, tokens: int, window: int, threads: int) -> dict[str, float]:
    from engine.morph.profiler import DEFAULT_TEXT, LayerSwitch, calibration_tokens, load_model, text_half
    from engine.precision import parse_dtype
    from engine.tokenizer import Tokenizer
    from ops.quality.perplexity import perplexity, perplexity_with, quantized_variants

    torch.set_num_threads(threads)
    _, hf_dir, net = load_model(model, parse_dtype("bf16"))
    tokenizer = Tokenizer.from_dir(hf_dir)
    eval_ids = tokenizer.encode(text_half(DEFAULT_TEXT, "second"))[:tokens]
    calib = calibration_tokens(tokenizer.encode(text_half(DEFAULT_TEXT, "first")), 1, 512)
    _, int4 = quantized_variants(net, calib, "awq")
    every = list(range(net.config.num_layers))
    return {"morphserve-static-fp": perplexity(net, eval_ids, window),
            "morphserve-static-int4": perplexity_with(net, LayerSwitch(net, int4), every, eval_ids, window)}
