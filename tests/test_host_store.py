"""HostStore: layout, manifest bytes, bit-exact full copies, AWQ / RTN / checkpoint INT4, reuse, atomic build."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from engine.errors import ModelLoadError
from engine.loader import load_config, load_weights
from engine.model import build_model, linear_shapes
from engine.morph import store_builder
from engine.morph.calibration import as_batch, full_precision_pass
from engine.morph.host_store import MANIFEST, HostStore, layer_file_name, store_root
from engine.morph.layer_swapper import build_linears
from engine.morph.store_builder import StoreSpec, ensure_host_store
from engine.precision import Precision
from engine.quant import Int4Weight, Int8Weight
from engine.quant.awq import rms_norm

LADDER = (Precision.INT8, Precision.INT4)
CALIB = [[(7 * i + 3) % 250 + 3 for i in range(20)], [(11 * i + 5) % 250 + 3 for i in range(20)]]


def tiny_model(model_dir, dtype=torch.float32):
    return build_model(load_config(model_dir), load_weights(model_dir, dtype), dtype, "cpu")


def spec_for(model_dir, **kw) -> StoreSpec:
    args = dict(model_name="tiny", hf_dir=model_dir, full=Precision.FP32, ladder=LADDER, int4_group_size=64,
                calibration="none", awq_grid=3)
    args.update(kw)
    return StoreSpec(**args)


@pytest.fixture(scope="module")
def awq_store(tiny_model_dir, tmp_path_factory):
    model = tiny_model(tiny_model_dir)
    return model, ensure_host_store(model, spec_for(tiny_model_dir), tmp_path_factory.mktemp("cache"),
                                    calibration_ids=CALIB)


def test_layout_and_manifest(awq_store):
    model, store = awq_store
    m = store.manifest
    assert store.path.parent == store_root(store.path.parents[3], "tiny")
    assert m.precisions == ("fp32", "int8", "int4") and m.num_layers == 4 and m.dtype == "fp32"
    assert m.int4_method == "awq" and m.calibration["tokens"] == 40
    assert m.int4_group_sizes == {"q_proj": 64, "k_proj": 64, "v_proj": 64, "o_proj": 64, "gate_proj": 64,
                                  "up_proj": 64, "down_proj": 64}
    names = sorted(p.name for p in store.path.iterdir())
    assert names == sorted([MANIFEST] + [layer_file_name(i, p) for i in range(4) for p in (Precision.FP32, *LADDER)])


def test_manifest_bytes_equal_built_modules(awq_store):
    model, store = awq_store
    for layer in range(4):
        assert store.layer_bytes(layer, Precision.FP32) == model.layer_weight_bytes(layer)
        for p in LADDER:
            linears, _ = build_linears(store.read(layer, p), torch.device("cpu"))
            assert store.layer_bytes(layer, p) == sum(lin.nbytes() for lin in linears.values())
            assert {lin.precision for lin in linears.values()} == {p}
    full, int8, int4 = (store.layer_bytes(0, p) for p in (Precision.FP32, *LADDER))
    assert int4 < int8 < full


def test_full_copy_is_bit_identical_and_owned(awq_store):
    model, store = awq_store
    for layer in range(4):
        stored = store.read(layer, Precision.FP32)
        for name, lin in model.layers[layer].get_linears().items():
            assert stored.linears[name].dtype == torch.float32
            assert torch.equal(stored.linears[name], lin.weight)
        for name, w in model.layers[layer].get_norm_weights().items():
            assert torch.equal(stored.norms[name], w)
    a, b = store.read(0, Precision.FP32), store.read(0, Precision.FP32)
    assert a.linears["q_proj"].data_ptr() != b.linears["q_proj"].data_ptr()  # copies, not the shared map


def test_awq_is_no_worse_than_rtn_on_calibration_tokens(awq_store, tiny_model_dir, tmp_path):
    model, store = awq_store
    rtn = ensure_host_store(model, spec_for(tiny_model_dir), tmp_path)  # calibration "none" -> RTN
    assert rtn.manifest.int4_method == "rtn" and "round-to-nearest" in rtn.manifest.calibration["reason"]
    assert rtn.path.name != store.path.name
    calib = full_precision_pass(model, as_batch(CALIB))[2]
    eps = model.config.rms_norm_eps
    for layer in range(4):
        x = calib[layer].hidden
        ref = rms_norm(x, model.layers[layer].input_layernorm.weight, eps) @ model.layers[layer].q_proj.weight.t()

        def q_error(s):
            v = s.read(layer, Precision.INT4)
            y = rms_norm(x, v.norms["input_layernorm"], eps) @ v.linears["q_proj"].dequantize().t()
            return (y - ref).pow(2).mean().item()
        assert q_error(store) <= q_error(rtn) * 1.05  # AWQ's search includes RTN (alpha = 0)


def test_reuse_without_rebuilding(awq_store, tiny_model_dir, monkeypatch):
    model, store = awq_store
    monkeypatch.setattr(store_builder, "build_store", lambda *a, **k: pytest.fail("rebuilt an existing store"))
    again = ensure_host_store(model, spec_for(tiny_model_dir), store.path.parents[3], calibration_ids=CALIB)
    assert again.path == store.path


def test_crashed_build_is_cleaned_and_rebuilt(tiny_model_dir, tmp_path):
    model = tiny_model(tiny_model_dir)
    spec = spec_for(tiny_model_dir, ladder=(Precision.INT8,))
    first = ensure_host_store(model, spec, tmp_path)
    (first.path / MANIFEST).unlink()  # as if the process died before the manifest was written
    stale = first.path.parent / f".tmp-{first.path.name}-999999"
    stale.mkdir()
    second = ensure_host_store(model, spec, tmp_path)
    assert second.path == first.path and (second.path / MANIFEST).is_file() and not stale.exists()
    assert second.manifest.precisions == ("fp32", "int8")


def test_settings_change_the_fingerprint(tiny_model_dir, tmp_path):
    model = tiny_model(tiny_model_dir)
    a = ensure_host_store(model, spec_for(tiny_model_dir, int4_group_size=64), tmp_path)
    b = ensure_host_store(model, spec_for(tiny_model_dir, int4_group_size=32), tmp_path)
    assert a.path != b.path and b.manifest.int4_group_sizes["q_proj"] == 32


def test_missing_variant_file_is_a_clear_error(tiny_model_dir, tmp_path):
    store = ensure_host_store(tiny_model(tiny_model_dir), spec_for(tiny_model_dir), tmp_path)
    os.remove(store.path / layer_file_name(2, Precision.INT8))
    with pytest.raises(ModelLoadError, match=r"layer 2 at int8.*prepare"):
        HostStore(store.path)


def _awq_checkpoint(folder, config, group: int, hidden_override: int | None = None):
    """A random AutoAWQ GEMM checkpoint with the tiny model's shapes (or a wrong hidden size)."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    shapes = linear_shapes(config)
    for i in range(config.num_layers):
        for name, (out_f, in_f) in shapes.items():
            if hidden_override and in_f == config.hidden_size:
                in_f = hidden_override
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"model.layers.{i}.{part}.{name}"
            tensors[f"{p}.qweight"] = torch.randint(-2**31, 2**31 - 1, (in_f, out_f // 8), generator=g, dtype=torch.int32)
            tensors[f"{p}.qzeros"] = torch.randint(-2**31, 2**31 - 1, (in_f // group, out_f // 8), generator=g, dtype=torch.int32)
            tensors[f"{p}.scales"] = (torch.rand(in_f // group, out_f, generator=g) / 50).half()
        for n in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{n}.weight"] = torch.full((config.hidden_size,), 1.25, dtype=torch.float16)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config": qc}))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_int4_from_awq_checkpoint(tiny_model_dir, tmp_path):
    model = tiny_model(tiny_model_dir)
    ckpt = _awq_checkpoint(tmp_path / "awq", model.config, group=32)
    store = ensure_host_store(model, spec_for(tiny_model_dir, int4_checkpoint=ckpt), tmp_path / "cache")
    assert store.manifest.int4_method == f"checkpoint:{ckpt}"
    layer = store.read(0, Precision.INT4)
    assert all(isinstance(r, Int4Weight) and r.group_size == 32 for r in layer.linears.values())
    assert torch.equal(layer.norms["input_layernorm"], torch.full((64,), 1.25))
    assert isinstance(store.read(0, Precision.INT8).linears["q_proj"], Int8Weight)  # INT8 stays RTN


def test_awq_checkpoint_with_wrong_shapes_is_refused(tiny_model_dir, tmp_path):
    model = tiny_model(tiny_model_dir)
    ckpt = _awq_checkpoint(tmp_path / "awq", model.config, group=32, hidden_override=96)
    with pytest.raises(ModelLoadError, match=r"does not fit model tiny at layer 0.*expected shape"):
        ensure_host_store(model, spec_for(tiny_model_dir, int4_checkpoint=ckpt), tmp_path / "cache")
    assert not any((tmp_path / "cache").rglob(MANIFEST))  # nothing half-built is left to be reused
