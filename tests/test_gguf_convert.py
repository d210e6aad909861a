"""GGUF -> Hugging Face folder: tiny synthetic GGUF files (fast, exact) and the real default model
checked against transformers' own GGUF loading."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.errors import ModelLoadError
from engine.gguf_convert import COMPLETE_MARKER, convert_gguf, hf_tensor_name
from engine.loader import load_config

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 128
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF -> GGUF converter does to q_proj / k_proj rows (written from its description)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_tensors(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                       p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                       p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, FFN)})
        if arch == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (HIDDEN,), p + "self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
                           p + "self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}"


def write_tiny_gguf(path: Path, arch: str = "llama", tied: bool = False, q8_names: tuple[str, ...] = (),
                    extra_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None) -> dict[str, np.ndarray]:
    """A tiny GGUF as llama.cpp would write it; returns the HF tensors it encodes (Q8_0 ones dequantized)."""
    hf = tiny_hf_tensors(arch, tied)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, t in hf.items():
        g = t
        if arch == "llama" and ".q_proj." in name:
            g = llama_cpp_permute(t, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            g = llama_cpp_permute(t, KV_HEADS)
        if name in q8_names:
            q = gguf.quants.quantize(g, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # Q8_0 blocks run along a row, so the row permutation commutes with quantization.
            q_hf = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            hf[name] = np.asarray(gguf.quants.dequantize(q_hf, gguf.GGMLQuantizationType.Q8_0)).reshape(t.shape)
        else:
            w.add_tensor(gguf_name(name), g)
    for name, (data, qtype) in (extra_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_tensor_names_map_to_hf():
    assert hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ModelLoadError, match="no Llama-family counterpart"):
        hf_tensor_name("blk.0.attn_qkv.weight")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trips_exactly(tmp_path, arch):
    q8 = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.weight")
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch, q8_names=q8)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].dtype == torch.float32
        # q_proj / k_proj are exact only if the llama.cpp permutation was undone correctly.
        assert torch.equal(got[name], torch.from_numpy(want)), name
    cfg = load_config(out)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (arch, LAYERS, HEADS, KV_HEADS, HEAD_DIM)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (HIDDEN, FFN, VOCAB)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 10000.0 and not cfg.tie_word_embeddings
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert (out / COMPLETE_MARKER).is_file()


def test_missing_output_weight_means_tied_embeddings(tmp_path):
    write_tiny_gguf(tmp_path / "tied.gguf", tied=True)
    out = convert_gguf(tmp_path / "tied.gguf", tmp_path / "hf")
    assert load_config(out).tie_word_embeddings
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))


def test_unsupported_architecture_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match="architecture 'falcon' is not supported"):
        convert_gguf(tmp_path / "falcon.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_undequantizable_tensor_type_fails_without_leaving_a_folder(tmp_path):
    # Q8_1 has no dequantizer in the gguf package. It comes last, so the failure hits mid-conversion.
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((FFN, HIDDEN // block * type_size), np.uint8)
    write_tiny_gguf(tmp_path / "q81.gguf", extra_tensors={"blk.2.ffn_up.weight": (raw, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(ModelLoadError, match="Q8_1"):
        convert_gguf(tmp_path / "q81.gguf", tmp_path / "out" / "hf")
    assert list((tmp_path / "out").iterdir()) == []  # neither the folder nor its temporary sibling


def test_existing_output_folder_is_not_overwritten(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "hf").mkdir()
    with pytest.raises(ModelLoadError, match="already exists"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="cannot read"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "hf")


# --- the real default model (converted once per machine into the cache by the conftest fixture) ---

@pytest.fixture(scope="module")
def transformers_gguf_state():
    """transformers' own GGUF loading of the embedded file: the independent reference."""
    from transformers import AutoModelForCausalLM

    from engine.default_model import default_gguf_path

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.slow
def test_default_model_weights_match_transformers_gguf_loading(default_model_dir, transformers_gguf_state):
    got = load_file(str(default_model_dir / "model.safetensors"))
    ref = transformers_gguf_state
    assert set(got) == set(ref) - {"lm_head.weight"}  # tied: transformers materializes the alias
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.17.self_attn.q_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.layers.5.mlp.down_proj.weight",
                 "model.layers.3.input_layernorm.weight", "model.norm.weight"):
        assert got[name].shape == ref[name].shape, name
        assert (got[name] - ref[name]).abs().max().item() == 0.0, name


def test_default_model_config_fields(default_model_dir):
    cfg = load_config(default_model_dir)
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.max_position_embeddings) == (49152, 1536, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    tok_cfg = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
