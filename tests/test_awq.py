"""The project's AWQ: folding keeps the full-precision layer function, and AWQ INT4 beats plain RTN
INT4 on a layer whose input has a few large channels."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.model_config import ModelConfig
from engine.precision import Precision
from engine.quant import Int4Weight, Int8Weight
from engine.quant.awq import (LINEAR_NAMES, LayerCalibration, LayerWeights, QuantizedLayer, apply_awq_scales,
                              awq_quantize_layer, hf_name, quantize_layer_rtn, record_calibration, rms_norm,
                              search_awq_scales)

CONFIG = ModelConfig(architecture="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=512, tie_word_embeddings=False, attention_bias=True)
OUTLIERS = [3, 17, 90]


def random_layer(seed: int = 0) -> LayerWeights:
    g = torch.Generator().manual_seed(seed)
    h, i, q, kv = CONFIG.hidden_size, CONFIG.intermediate_size, CONFIG.q_size, CONFIG.kv_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    linears = {n: torch.randn(s, generator=g) * 0.08 for n, s in shapes.items()}
    norms = {n: 1 + 0.1 * torch.randn(h, generator=g) for n in ("input_layernorm", "post_attention_layernorm")}
    biases = {n: 0.1 * torch.randn(shapes[n][0], generator=g) for n in ("q_proj", "k_proj", "v_proj")}
    return LayerWeights(linears, norms, biases)


def outlier_inputs(seed: int, batch: int = 4, seq: int = 48) -> torch.Tensor:
    """[B, S, hidden] activations with a few channels 25x larger than the rest (as in real LLMs)."""
    x = torch.randn(batch, seq, CONFIG.hidden_size, generator=torch.Generator().manual_seed(seed))
    x[..., OUTLIERS] *= 25
    return x


def reference_layer(layer: LayerWeights, x: torch.Tensor, tap_o=None, tap_residual=None) -> tuple[torch.Tensor, LayerCalibration]:
    """A plain decoder layer (causal GQA attention without RoPE; RoPE does not change what AWQ sees).
    The taps see o_proj's and post_attention_layernorm's inputs (modules, for hooks)."""
    w, b = layer.linears, layer.biases
    bsz, seq, _ = x.shape
    hq, hkv, d = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    n1 = rms_norm(x, layer.norms["input_layernorm"], CONFIG.rms_norm_eps)
    q = F.linear(n1, w["q_proj"], b.get("q_proj")).view(bsz, seq, hq, d).transpose(1, 2)  # [B, Hq, S, D]
    k = F.linear(n1, w["k_proj"], b.get("k_proj")).view(bsz, seq, hkv, d).transpose(1, 2)  # [B, Hkv, S, D]
    v = F.linear(n1, w["v_proj"], b.get("v_proj")).view(bsz, seq, hkv, d).transpose(1, 2)
    k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bsz, seq, hq * d)
    h = x + F.linear(attn if tap_o is None else tap_o(attn), w["o_proj"])
    n2 = rms_norm(h if tap_residual is None else tap_residual(h), layer.norms["post_attention_layernorm"], CONFIG.rms_norm_eps)
    out = h + F.linear(F.silu(F.linear(n2, w["gate_proj"])) * F.linear(n2, w["up_proj"]), w["down_proj"])
    calib = LayerCalibration(hidden=x.reshape(-1, x.shape[-1]), attn_out=attn.reshape(-1, hq * d),
                             residual=h.reshape(-1, h.shape[-1]))
    return out, calib


def dequantized(q: QuantizedLayer) -> LayerWeights:
    return LayerWeights({n: r.dequantize() for n, r in q.linears.items()}, dict(q.norms), dict(q.biases))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_folding_keeps_the_full_precision_function():
    layer = random_layer()
    x = outlier_inputs(seed=1)
    ref, calib = reference_layer(layer, x)
    g = torch.Generator().manual_seed(3)
    arbitrary = {"qkv": torch.rand(128, generator=g) * 4 + 0.25, "o": torch.rand(CONFIG.kv_size, generator=g) * 4 + 0.25,
                 "gate_up": torch.rand(128, generator=g) * 4 + 0.25, "down": torch.rand(256, generator=g) * 4 + 0.25}
    searched = search_awq_scales(layer, calib, CONFIG, group_size=64)
    assert float(searched["qkv"].max() / searched["qkv"].min()) > 2  # the outliers did move the scales
    for scales in (arbitrary, searched):
        folded = apply_awq_scales(layer, scales, CONFIG)
        assert not torch.equal(folded.norms["input_layernorm"], layer.norms["input_layernorm"])
        out, _ = reference_layer(folded, x)
        # Scale then unscale: only fp32 rounding differs (a few ulps through two residual blocks).
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4 * float(ref.abs().max()))


def test_awq_beats_rtn_int4_on_outlier_channels():
    layer = random_layer()
    _, calib = reference_layer(layer, outlier_inputs(seed=1))
    held_out = outlier_inputs(seed=2)
    ref, _ = reference_layer(layer, held_out)
    rtn = quantize_layer_rtn(layer, Precision.INT4, group_size=64)
    awq = awq_quantize_layer(layer, calib, CONFIG, group_size=64)
    awq.check_integrity()
    assert all(isinstance(r, Int4Weight) and r.group_size == 64 for r in awq.linears.values())
    err_rtn = relative_error(reference_layer(dequantized(rtn), held_out)[0], ref)
    err_awq = relative_error(reference_layer(dequantized(awq), held_out)[0], ref)
    assert err_awq < 0.8 * err_rtn, (err_awq, err_rtn)


@pytest.mark.parametrize("precision,record_type", [(Precision.INT8, Int8Weight), (Precision.INT4, Int4Weight)])
def test_rtn_layer(precision, record_type):
    layer = random_layer()
    q = quantize_layer_rtn(layer, precision, group_size=128)
    q.check_integrity()
    assert set(q.linears) == set(LINEAR_NAMES) and all(isinstance(r, record_type) for r in q.linears.values())
    assert all(torch.equal(q.norms[n], layer.norms[n]) for n in layer.norms)
    x = outlier_inputs(seed=4, batch=1)
    ref, _ = reference_layer(layer, x)
    bound = 0.02 if precision == Precision.INT8 else 0.2
    assert relative_error(reference_layer(dequantized(q), x)[0], ref) < bound
    with pytest.raises(ValueError, match="int8 or int4"):
        quantize_layer_rtn(layer, Precision.BF16)


def test_layer_weights_from_hf_names():
    layer = random_layer()
    hf = {hf_name(n): t for n, t in layer.linears.items()}
    hf.update({hf_name(n, "bias"): t for n, t in layer.biases.items()})
    hf.update({f"{n}.weight": t for n, t in layer.norms.items()})
    back = LayerWeights.from_hf(hf)
    assert set(back.biases) == {"q_proj", "k_proj", "v_proj"}
    assert torch.equal(back.linears["down_proj"], layer.linears["down_proj"])
    del hf["mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match="mlp.up_proj.weight"):
        LayerWeights.from_hf(hf)


def test_quantized_layer_integrity_catches_mixed_records():
    q = quantize_layer_rtn(random_layer(), Precision.INT4, 64)
    mixed = dict(q.linears)
    mixed["o_proj"] = quantize_layer_rtn(random_layer(), Precision.INT8).linears["o_proj"]
    with pytest.raises(ValueError, match="o_proj is Int8Weight"):
        QuantizedLayer(Precision.INT4, mixed, q.norms, q.biases).check_integrity()


class HookableLayer(torch.nn.Module):
    """The reference layer with the submodules record_calibration hooks (as engine.model's DecoderLayer has)."""

    def __init__(self, layer: LayerWeights):
        super().__init__()
        self.layer = layer
        self.o_proj, self.post_attention_layernorm = torch.nn.Identity(), torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_layer(self.layer, x, self.o_proj, self.post_attention_layernorm)[0]


def test_record_calibration_captures_the_three_inputs():
    layer, x1, x2 = random_layer(), outlier_inputs(seed=5, batch=1), outlier_inputs(seed=6, batch=2)
    module = HookableLayer(layer)
    with record_calibration(module) as calib:
        module(x1)
        module(x2)
    expected = [reference_layer(layer, x)[1] for x in (x1, x2)]
    for field in ("hidden", "attn_out", "residual"):
        assert torch.equal(getattr(calib[0], field), torch.cat([getattr(e, field) for e in expected]))
    module(x1)  # hooks are gone: nothing more is recorded
    assert calib[0].hidden.shape[0] == 3 * x1.shape[1]
    with pytest.raises(ValueError, match="no forward pass"):
        with record_calibration(module):
            pass


def test_build_linears_apply_the_quantized_weights():
    layer = random_layer()
    q = quantize_layer_rtn(layer, Precision.INT4, group_size=64)
    linears = q.build_linears("cpu")
    for name in LINEAR_NAMES:
        lin, rec = linears[name], q.linears[name]
        x = torch.randn(5, rec.in_features).to(torch.bfloat16)
        assert (lin.out_features, lin.in_features) == (rec.out_features, rec.in_features)
        ref = x.float() @ lin.dequantize().t() + (q.biases[name] if name in q.biases else 0)
        assert torch.allclose(lin(x).float(), ref, rtol=2 ** -6, atol=2 ** -6 * float(ref.abs().max())), name
    assert linears["q_proj"].bias is not None and linears["o_proj"].bias is None


def test_calibration_of_the_wrong_width_is_rejected():
    layer = random_layer()
    _, calib = reference_layer(layer, outlier_inputs(seed=1, batch=1))
    bad = LayerCalibration(calib.hidden, calib.attn_out[:, :64], calib.residual)
    with pytest.raises(ValueError, match="attn_out must be \\[tokens, 128\\]"):
        search_awq_scales(layer, bad, CONFIG)
