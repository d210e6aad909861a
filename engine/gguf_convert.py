"""GGUF file -> standard Hugging Face folder (config.json, model.safetensors, tokenizer, generation config).

Every tensor is dequantized with the `gguf` package and stored as float32, so the folder holds exactly
the values the GGUF encodes. llama.cpp's converter permutes the rows of q_proj / k_proj (and their
biases) for its rotary kernel; for llama-arch files we undo that here so the folder is a plain HF model:

    HF -> GGUF:  w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)   (per head: halves -> pairs)
    GGUF -> HF:  w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2)   (pairs -> halves)

The folder is written into a temporary sibling and renamed into place, so a crash never leaves half a
model behind; the marker file COMPLETE_MARKER is the last file written inside it.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.model_config import ModelConfig

COMPLETE_MARKER = ".morphserve-complete"
# Bump when the folder this writes changes meaning; cached folders of another format are redone.
CONVERTER_FORMAT = 1

# GGUF arch -> (ModelConfig.architecture, whether llama.cpp permuted the Q/K rows).
# Mistral 7B-style files use the "llama" arch in GGUF; qwen2 keeps HF's neox-style rope, unpermuted.
_ARCHS = {"llama": ("llama", True), "mistral": ("mistral", True), "qwen2": ("qwen2", False)}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; raises for unknown names."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ModelLoadError(
        f"GGUF tensor {gguf_name!r} has no Llama-family counterpart; this file's architecture is not "
        f"supported (MorphServe converts llama / mistral / qwen2 GGUF files)")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row interleaving (works for 2-D weights and 1-D biases)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute a tensor with {rows} rows for {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every scalar / string / small array key of the GGUF header (tokens and merges included)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an exotic value type we do not need; skip rather than fail the model
            continue
    return meta


def gguf_model_config(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """ModelConfig from GGUF header keys ('{arch}.block_count', ...)."""
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {gguf_arch!r} is not supported; MorphServe converts {sorted(_ARCHS)} files")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("this GGUF carries Llama-3.1 rope frequency factors (rope_freqs.weight), which the "
                             "converter does not map; use the model's Hugging Face folder instead")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{gguf_arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF header lacks {gguf_arch}.{name}; the file is incomplete or not a decoder LM")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    vocab = meta.get(f"{gguf_arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or None
    if vocab is None:
        raise ModelLoadError("GGUF header gives no vocabulary size (neither {arch}.vocab_size nor tokens)")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=_ARCHS[gguf_arch][0],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=_rope_scaling(meta, gguf_arch),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _f32(x: Any) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06; keep the short decimal form."""
    return float(f"{float(x):.7g}")


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported; use the model's Hugging Face folder instead")


def dequantized_state_dict(reader: Any, cfg: ModelConfig, permuted: bool) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors, Q/K rows restored to HF order when llama.cpp permuted them."""
    from gguf.quants import dequantize

    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        try:
            w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy: F32 data is a read-only mmap
        except NotImplementedError:
            raise ModelLoadError(f"GGUF tensor {t.name} uses {t.tensor_type.name}, which the gguf package cannot "
                                 f"dequantize; re-export the model as F16/Q8_0/Q4_0/Q4_1/Q4_K/...") from None
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims fastest-first
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(gguf_path: Path, meta: dict[str, Any], out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) via transformers' GGUF
    tokenizer conversion; transformers is only imported here, at conversion time."""
    if "tokenizer.ggml.model" not in meta:
        return  # weights-only GGUF: the folder is usable, Tokenizer.from_dir will say what is missing
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
        tok.save_pretrained(str(out))
    except Exception as e:
        raise ModelLoadError(f"cannot convert the tokenizer of {gguf_path} ({type(e).__name__}: {e}); "
                             f"use the model's Hugging Face folder instead") from e
    # One source of truth for the template: tokenizer_config.json (transformers 5 also writes a .jinja).
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        tok_cfg["chat_template"] = template
        (out / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    # Loader bookkeeping of this transformers version, and its private class name: keep the folder
    # loadable by any transformers (PreTrainedTokenizerFast) and free of local-path state.
    for k in ("is_local", "local_files_only", "backend"):
        tok_cfg.pop(k, None)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(cfg_path, tok_cfg)


def _write_configs(cfg: ModelConfig, meta: dict[str, Any], out: Path) -> None:
    config = cfg.to_hf_dict()
    config["torch_dtype"] = "float32"  # what model.safetensors holds
    _write_json(out / "config.json", config)
    gen: dict[str, Any] = {"bos_token_id": cfg.bos_token_id}
    gen["eos_token_id"] = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0]
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        gen["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    _write_json(out / "generation_config.json", {k: v for k, v in gen.items() if v is not None})


def is_complete(hf_dir: Path) -> bool:
    """True if hf_dir is a finished conversion in the current CONVERTER_FORMAT."""
    try:
        marker = json.loads((Path(hf_dir) / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CONVERTER_FORMAT


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a llama / mistral / qwen2 GGUF file into a Hugging Face folder at out_dir (which must not
    exist yet). Returns out_dir. Raises ModelLoadError with what to change if the file cannot be used."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist; pass the path of a .gguf file")
    if out_dir.exists():
        raise ModelLoadError(f"{out_dir} already exists; remove it or convert into a new folder")
    try:
        reader = GGUFReader(gguf_path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {gguf_path} as GGUF ({e}); check the file is a complete .gguf") from e
    meta = read_metadata(reader)
    gguf_arch = meta.get("general.architecture")
    cfg = gguf_model_config(meta, {t.name for t in reader.tensors})
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        state = dequantized_state_dict(reader, cfg, permuted=_ARCHS[gguf_arch][1])
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors creates it 0600; replicas may run as other users
        del state
        _write_configs(cfg, meta, tmp)
        _write_tokenizer(gguf_path, meta, tmp)
        _write_json(tmp / COMPLETE_MARKER, {"format": CONVERTER_FORMAT, "source": str(gguf_path),
                                            "size": gguf_path.stat().st_size})
        os.rename(tmp, out_dir)  # atomic on one filesystem; fails if another writer got there first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
