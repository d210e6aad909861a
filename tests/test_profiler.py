"""The Layer Importance Score profiler on a tiny random model: a valid swap order, bounded scores, the
greedy property (checked against an independent whole-model recomputation at step 1), a model left
untouched, and the JSON that engine.morph.swap_order reads back."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_hf_model
from engine.loader import load_config, load_weights
from engine.model import build_model
from engine.morph.calibration import DenseRunner, as_batch, token_windows
from engine.morph.profiler import WEIGHTS, make_quantizer, profile_layers, token_cosine
from engine.morph.swap_order import load_swap_order
from engine.errors import ModelLoadError
from engine.precision import Precision
from engine.quant.awq import LayerWeights, quantize_layer_rtn

NUM_LAYERS = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_dir = make_tiny_hf_model(tmp_path_factory.mktemp("lis"), num_hidden_layers=NUM_LAYERS)
    config = load_config(hf_dir)
    model = build_model(config, load_weights(hf_dir, torch.float32), torch.float32, "cpu")
    tokens = torch.randint(3, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    return model, tokens


@pytest.fixture(scope="module")
def profile(tiny):
    model, tokens = tiny
    return profile_layers(model, tokens, make_quantizer("rtn", model.config, 32), "tiny")


def test_order_is_a_permutation_and_scores_are_cosines(profile):
    assert sorted(profile.order) == list(range(NUM_LAYERS))
    for step in profile.steps:
        for score in (step.lts, step.lrs, step.mds, step.lis):
            assert -1.0 - 1e-6 <= score <= 1.0 + 1e-6
        assert step.lis == pytest.approx(WEIGHTS[0] * step.lts + WEIGHTS[1] * step.lrs + WEIGHTS[2] * step.mds)


def test_each_step_picks_the_highest_lis_among_the_remaining(profile):
    remaining = set(range(NUM_LAYERS))
    for step in profile.steps:
        assert set(step.candidates) == remaining
        assert step.lis == max(step.candidates.values())
        remaining.remove(step.layer)


def _whole_model_final(model, tokens, quantized_layer=None, variant=None):
    """Final hidden state of a plain full forward, optionally with one layer set to `variant`."""
    runner = DenseRunner(model, *tokens.shape)
    saved = None
    if quantized_layer is not None:
        layer = model.layers[quantized_layer]
        saved = (layer.get_linears(), layer.get_norm_weights())
        layer.set_weights(variant.build_linears("cpu"), variant.norms)
    try:
        with torch.inference_mode():
            return runner.final(runner.run_layers(runner.embed(tokens), 0))
    finally:
        if saved is not None:
            model.layers[quantized_layer].set_weights(*saved)


def test_step_one_matches_an_independent_recomputation(tiny, profile):
    model, tokens = tiny
    reference = _whole_model_final(model, tokens)
    runner = DenseRunner(model, *tokens.shape)
    with torch.inference_mode():
        inputs = [runner.embed(tokens)]
        for i in range(NUM_LAYERS):
            inputs.append(runner.run_layer(i, inputs[-1]))
    lis = {}
    for p in range(NUM_LAYERS):
        variant = quantize_layer_rtn(LayerWeights.of_layer(model.layers[p]), Precision.INT4, 32)
        mds = token_cosine(reference, _whole_model_final(model, tokens, p, variant))
        lts = token_cosine(inputs[p + 1], inputs[p])
        saved = (model.layers[p].get_linears(), model.layers[p].get_norm_weights())
        model.layers[p].set_weights(variant.build_linears("cpu"), variant.norms)
        with torch.inference_mode():
            lrs = token_cosine(inputs[p + 1], runner.run_layer(p, inputs[p]))
        model.layers[p].set_weights(*saved)
        lis[p] = 0.25 * lts + 0.25 * lrs + 0.5 * mds
    first = profile.steps[0]
    assert first.layer == max(lis, key=lambda p: (lis[p], -p))
    for p, value in lis.items():
        assert first.candidates[p] == pytest.approx(value, abs=1e-5)


def test_profiling_leaves_the_model_at_full_precision(tiny, profile):
    model, tokens = tiny
    for layer in model.layers:
        assert all(lin.precision == Precision.FP32 for lin in layer.get_linears().values())
    # and computing the same profile again gives the same order (nothing leaked into the weights)
    again = profile_layers(model, tokens, make_quantizer("rtn", model.config, 32), "tiny", mds_sequences=2)
    assert again.order == profile.order


def test_mds_on_fewer_sequences_and_bad_arguments(tiny):
    model, tokens = tiny
    quick = profile_layers(model, tokens, make_quantizer("rtn", model.config, 32), "tiny", mds_sequences=1)
    assert sorted(quick.order) == list(range(NUM_LAYERS))
    assert quick.calibration["mds_sequences"] == 1
    with pytest.raises(ValueError, match="mds_sequences"):
        profile_layers(model, tokens, make_quantizer("rtn", model.config, 32), mds_sequences=3)
    with pytest.raises(ValueError, match="awq"):
        make_quantizer("gptq", model.config)


def test_awq_quantizer_gives_a_valid_profile(tiny):
    model, tokens = tiny
    prof = profile_layers(model, tokens, make_quantizer("awq", model.config, 32), "tiny")
    assert sorted(prof.order) == list(range(NUM_LAYERS))
    assert all(s.lrs > 0.5 for s in prof.steps)  # INT4 reproduces a layer far better than chance


def test_json_round_trip_and_swap_order(profile, tmp_path):
    path = tmp_path / "tiny.lis.json"
    profile.write(path)
    data = json.loads(path.read_text())
    assert data["model"] == "tiny" and data["num_layers"] == NUM_LAYERS
    assert data["order"] == profile.order
    assert [s["layer"] for s in data["scores"]] == profile.order
    assert set(data["scores"][0]) >= {"layer", "LTS", "LRS", "MDS", "LIS"}
    assert {"tokens", "sequences", "quantizer", "dtype", "seconds"} <= set(data["calibration"])
    assert load_swap_order(path, NUM_LAYERS, "tiny").order == tuple(profile.order)


class _Chars:
    """A tokenizer stand-in: one token per character."""

    def encode(self, text):
        return [ord(c) for c in text]


def test_calibration_windows_are_evenly_spaced_and_of_one_length():
    text = "".join(chr(ord("a") + i) for i in range(20))
    windows = token_windows(_Chars(), text, 3, 4)
    assert windows == [[97, 98, 99, 100], [105, 106, 107, 108], [113, 114, 115, 116]]  # starts 0, 8, 16
    assert as_batch(windows).shape == (3, 4)
    with pytest.raises(ModelLoadError, match="more"):
        token_windows(_Chars(), "abc", 2, 4)
    with pytest.raises(ModelLoadError, match="no tokenizer|has none"):
        token_windows(None, text, 2, 4)
    with pytest.raises(ValueError, match="one length"):
        as_batch([[1, 2], [3]])
