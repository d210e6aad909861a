"""AutoAWQ GEMM and compressed-tensors pack-quantized checkpoints: tensors packed here by hand from
known codes load back to exactly those codes, scales, zeros and weights; mismatches are clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine.errors import ModelLoadError
from engine.model_config import ModelConfig
from engine.quant.checkpoints import (Int4CheckpointFormat, int4_checkpoint_format, load_awq_linear, load_int4_layer,
                                      load_pack_quantized_linear, open_int4_checkpoint)

CONFIG = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=512, tie_word_embeddings=False)
SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
          "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}
GROUP = 32


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32 (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_last_dim(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[r, 8c] nibbles -> int32 [r, c]; nibble i of word c holds column 8c + order[i]."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    words = sum(v[..., order[i]] << (4 * i) for i in range(8))
    return to_int32(words).contiguous()


def known_int4(out_f: int, in_f: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (out_f, in_f // GROUP), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out_f, in_f // GROUP, generator=g) * 0.02 + 0.001).half()
    return codes, zeros, scales


def expected_weight(codes, zeros, scales) -> torch.Tensor:
    return (codes.float() - zeros.float().repeat_interleave(GROUP, 1)) * scales.float().repeat_interleave(GROUP, 1)


def awq_tensors(prefix: str, codes, zeros, scales) -> dict[str, torch.Tensor]:
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return {f"{prefix}.qweight": pack_last_dim(codes.t(), order), f"{prefix}.qzeros": pack_last_dim(zeros.t(), order),
            f"{prefix}.scales": scales.t().contiguous()}


def pack_quantized_tensors(prefix: str, codes, zeros, scales, symmetric: bool) -> dict[str, torch.Tensor]:
    t = {f"{prefix}.weight_packed": pack_last_dim(codes), f"{prefix}.weight_scale": scales.bfloat16(),
         f"{prefix}.weight_shape": torch.tensor(list(codes.shape))}
    if not symmetric:  # zero points packed along the output dimension: transpose, pack, transpose back
        t[f"{prefix}.weight_zero_point"] = pack_last_dim(zeros.t()).t().contiguous()
    return t


def check_loaded(rec, codes, zeros, scales):
    rec.check_integrity()
    assert torch.equal(rec.codes(), codes)
    assert torch.equal(rec.zeros, zeros)
    assert torch.equal(rec.scales, scales.float())
    assert torch.equal(rec.dequantize(), expected_weight(codes, zeros, scales))


def test_awq_gemm_linear_round_trip():
    codes, zeros, scales = known_int4(64, 128, seed=0)
    rec = load_awq_linear(awq_tensors("p", codes, zeros, scales), "p", 64, 128, GROUP)
    check_loaded(rec, codes, zeros, scales)
    assert rec.group_size == GROUP


@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_quantized_linear_round_trip(symmetric):
    codes, zeros, scales = known_int4(64, 128, seed=1)
    scales = scales.bfloat16().half()  # the test stores bf16 scales; keep values both dtypes hold exactly
    if symmetric:
        zeros = torch.full_like(zeros, 8)  # q_signed = code - 8, so w = q_signed * s
    tensors = pack_quantized_tensors("p", codes, zeros, scales, symmetric)
    rec = load_pack_quantized_linear(tensors, "p", 64, 128, GROUP, symmetric)
    check_loaded(rec, codes, zeros, scales)


def test_awq_nibble_order_is_not_the_natural_one():
    codes, zeros, scales = known_int4(64, 128, seed=2)
    wrong = {**awq_tensors("p", codes, zeros, scales), "p.qweight": pack_last_dim(codes.t())}
    assert not torch.equal(load_awq_linear(wrong, "p", 64, 128, GROUP).codes(), codes)


def write_checkpoint(folder, layout: str):
    known, tensors = {}, {}
    for i in range(CONFIG.num_layers):
        for j, (name, (out_f, in_f)) in enumerate(SHAPES.items()):
            codes, zeros, scales = known_int4(out_f, in_f, seed=100 * i + j)
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"model.layers.{i}.{part}.{name}"
            if layout == "awq":
                tensors.update(awq_tensors(prefix, codes, zeros, scales))
            else:
                scales = scales.bfloat16().half()
                tensors.update(pack_quantized_tensors(prefix, codes, zeros, scales, symmetric=False))
            known[(i, name)] = (codes, zeros, scales)
        for n in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{n}.weight"] = torch.full((64,), 1.5 + i, dtype=torch.float16)
    if layout == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": GROUP}}}}
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config": qc}))
    save_file(tensors, folder / "model.safetensors")
    return known


@pytest.mark.parametrize("layout", ["awq", "pack-quantized"])
def test_checkpoint_folder_loads_per_layer(tmp_path, layout):
    known = write_checkpoint(tmp_path, layout)
    fmt, tensors = open_int4_checkpoint(tmp_path)
    assert fmt == Int4CheckpointFormat(layout, GROUP, False)
    for i in range(CONFIG.num_layers):
        layer = load_int4_layer(tensors, fmt, CONFIG, i, dtype=torch.float32)
        for name, rec in layer.linears.items():
            check_loaded(rec, *known[(i, name)])
        assert torch.equal(layer.norms["input_layernorm"], torch.full((64,), 1.5 + i))
        assert layer.biases == {}


def test_shape_mismatch_names_tensor_and_shapes():
    codes, zeros, scales = known_int4(64, 128, seed=3)
    tensors = awq_tensors("p", codes, zeros, scales)
    with pytest.raises(ModelLoadError, match=r"p\.qweight: expected shape \[128, 16\], found \[128, 8\]"):
        load_awq_linear(tensors, "p", 128, 128, GROUP)  # the model says 128 outputs, the file has 64
    tensors = pack_quantized_tensors("p", codes, zeros, scales, symmetric=False)
    with pytest.raises(ModelLoadError, match=r"p\.weight_scale: expected shape \[64, 2\], found \[64, 4\]"):
        load_pack_quantized_linear(tensors, "p", 64, 128, 64, symmetric=False)  # wrong group size
    del tensors["p.weight_scale"]
    with pytest.raises(ModelLoadError, match="lacks tensor p.weight_scale"):
        load_pack_quantized_linear(tensors, "p", 64, 128, GROUP, symmetric=False)


def test_layer_with_a_mismatched_linear_is_rejected(tmp_path):
    write_checkpoint(tmp_path, "awq")
    fmt, tensors = open_int4_checkpoint(tmp_path)
    bigger = ModelConfig(**{**CONFIG.__dict__, "intermediate_size": 256})
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.gate_proj.qweight: expected shape \[64, 32\], found \[64, 16\]"):
        load_int4_layer(tensors, fmt, bigger, 0)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "zero_point": True}, "4-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"}, "GEMM"),
    ({"quant_method": "gptq", "bits": 4}, "unsupported quantization_config"),
    ({"format": "pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int",
                                                                      "strategy": "group", "group_size": 128}}}}, "4-bit"),
])
def test_unsupported_configs_are_rejected(qc, match):
    with pytest.raises(ModelLoadError, match=match):
        int4_checkpoint_format({"quantization_config": qc})
    assert int4_checkpoint_format({"architectures": ["LlamaForCausalLM"]}) is None
