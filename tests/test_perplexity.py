"""Perplexity on a tiny random model: it equals exp(mean NLL) computed with Hugging Face transformers on
the same weights, and quantizing layers moves it (and restores exactly)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_hf_model
from engine.loader import load_config, load_weights
from engine.model import build_model
from ops.quality.perplexity import (format_table, layer_orders, perplexity, perplexity_with, quantized_variants,
                                    window_nll)
from engine.morph.profiler import LayerSwitch

WINDOW = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_dir = make_tiny_hf_model(tmp_path_factory.mktemp("ppl"), num_hidden_layers=3)
    config = load_config(hf_dir)
    model = build_model(config, load_weights(hf_dir, torch.float32), torch.float32, "cpu")
    ids = torch.randint(3, config.vocab_size, (3 * WINDOW + 5,), generator=torch.Generator().manual_seed(1)).tolist()
    return hf_dir, model, ids


def test_one_window_matches_transformers(tiny):
    import transformers

    hf_dir, model, ids = tiny
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    window = torch.tensor([ids[:WINDOW]])
    with torch.inference_mode():
        logits = hf(window).logits[0, :-1].float()
    expected = math.exp(float(F.cross_entropy(logits, window[0, 1:])))
    got = perplexity(model, ids[:WINDOW], window=WINDOW)
    assert math.isfinite(got) and got > 1.0
    assert got == pytest.approx(expected, rel=1e-4)


def test_windows_are_pooled_by_token_and_partial_windows_dropped(tiny):
    _, model, ids = tiny
    parts = [window_nll(model, torch.tensor([ids[i * WINDOW:(i + 1) * WINDOW]])) for i in range(3)]
    pooled = math.exp(sum(n for n, _ in parts) / sum(c for _, c in parts))
    assert sum(c for _, c in parts) == 3 * (WINDOW - 1)
    assert perplexity(model, ids, window=WINDOW) == pytest.approx(pooled, rel=1e-5)  # 5 trailing tokens dropped
    with pytest.raises(ValueError, match="at least one window"):
        perplexity(model, ids[:WINDOW - 1], window=WINDOW)


def test_quantized_layers_change_perplexity_and_are_restored(tiny):
    _, model, ids = tiny
    calib = torch.tensor([ids[:WINDOW]])
    int8, int4 = quantized_variants(model, calib, "rtn")
    full = perplexity(model, ids, window=WINDOW)
    s4 = LayerSwitch(model, int4)
    all4 = perplexity_with(model, s4, [0, 1, 2], ids, WINDOW)
    assert math.isfinite(all4) and all4 != full
    assert perplexity(model, ids, window=WINDOW) == full  # restored bit-exactly
    assert perplexity_with(model, LayerSwitch(model, int8), [0, 1, 2], ids, WINDOW) != full


def test_orders_and_table():
    orders = layer_orders(4, [3, 1, 0, 2])
    assert orders["lis"] == [3, 1, 0, 2] and orders["front-to-back"] == [0, 1, 2, 3]
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders.values())
    assert orders["random-0"] == layer_orders(4, [0, 1, 2, 3])["random-0"]  # seeded: same every run
    results = {"full": 10.0, "int8-all": 10.1, "int4-all": 12.0,
               "int4-2": {"lis": 10.5, "front-to-back": 11.0, "random": 10.8}}
    table = format_table(results, [2])
    assert "2 layers INT4, lis" in table and "10.500" in table and "12.000" in table
