"""INT4 in the CPU kernel's layout: PackedInt4Weight round trips, the host store's packed copy builds
the very linear a fresh quantization builds, a swap-down packs nothing, restore stays bit-exact, and
another process's layout falls back to the canonical record."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_config, load_weights
from engine.model import LINEAR_NAMES, build_model
from engine.morph import host_store, store_builder
from engine.morph.actions import RestoreLayer, SwapLayer
from engine.morph.layer_swapper import build_linears
from engine.morph.store_builder import BuildPlan, StoreSpec, ensure_host_store
from engine.quant.awq import LayerWeights
from engine.precision import Precision
from engine.quant import Int4Linear, Int4Weight, PackedInt4Weight, from_tensors, pack_int4, quantize_int4, to_tensors
from engine.quant import int4_kernel
from engine.quant.awq import quantize_layer_rtn

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on a shared box: a second thread only synchronises
    yield
    torch.set_num_threads(before)


def weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05


def same_linear(a: Int4Linear, b: Int4Linear, in_features: int) -> None:
    """Same buffers, bit for bit, and so the same outputs."""
    assert a.backend == b.backend and a.layout == b.layout
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scales_and_zeros, b.scales_and_zeros)
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(a(x.to(dtype)), b(x.to(dtype)))


@pytest.mark.parametrize("shape", [(192, 576), (40, 64)])  # the kernel's layout, and the dequantize path
def test_packed_record_round_trips_and_builds_the_same_linear(shape, tmp_path):
    rec = quantize_int4(weight(*shape), 64)
    fresh = Int4Linear(rec)
    tensors, metadata = to_tensors(pack_int4(rec), "q_proj.kernel.")
    save_file(tensors, tmp_path / "p.safetensors", metadata=metadata)
    back = from_tensors(load_file(tmp_path / "p.safetensors"), metadata, "q_proj.kernel.")
    assert isinstance(back, PackedInt4Weight) and back.layout == fresh.layout
    loaded = Int4Linear(back)
    same_linear(loaded, fresh, shape[1])
    assert torch.equal(loaded.codes(), rec.codes())  # the reference path reads codes back from the layout
    assert torch.equal(loaded.dequantize(), fresh.dequantize())
    assert loaded.nbytes() == fresh.nbytes()


def test_packed_record_for_another_layout_is_refused():
    packed = pack_int4(quantize_int4(weight(64, 128), 64))
    assert packed.layout == int4_kernel.cpu_layout() and packed.layout.startswith("cpu:torch-")
    other = PackedInt4Weight(packed.packed, packed.scales_and_zeros, 64, "cpu:torch-0.0:AVX2:inner1:0")
    with pytest.raises(ValueError, match="packed as 'cpu:torch-0.0.*canonical Int4Weight"):
        Int4Linear(other)
    with pytest.raises(ValueError, match="needs 4096"):
        PackedInt4Weight(packed.packed[:8], packed.scales_and_zeros, 64, packed.layout).check_integrity()


@pytest.fixture(scope="module")
def rtn_store(tiny_model_dir, tmp_path_factory):
    model = build_model(load_config(tiny_model_dir), load_weights(tiny_model_dir, torch.float32), torch.float32, "cpu")
    spec = StoreSpec(model_name="tiny", hf_dir=tiny_model_dir, full=Precision.FP32,
                     ladder=(Precision.INT8, Precision.INT4), int4_group_size=64, calibration="none")
    return model, spec, ensure_host_store(model, spec, tmp_path_factory.mktemp("cache"))


def test_store_layer_builds_the_freshly_quantized_linears(rtn_store):
    model, _, store = rtn_store
    for layer in range(store.num_layers):
        fresh = quantize_layer_rtn(LayerWeights.of_layer(model.layers[layer]), Precision.INT4, 64)
        packed = store.read(layer, Precision.INT4, CPU)
        assert all(isinstance(r, PackedInt4Weight) for r in packed.linears.values())
        assert all(isinstance(r, Int4Weight) for r in store.read(layer, Precision.INT4).linears.values())
        linears, norms = build_linears(packed, CPU)
        for name in LINEAR_NAMES:
            same_linear(linears[name], Int4Linear(fresh.linears[name]), fresh.linears[name].in_features)
        assert all(torch.equal(norms[n], fresh.norms[n]) for n in norms)
        assert store.layer_bytes(layer, Precision.INT4) == sum(lin.nbytes() for lin in linears.values())


def test_another_processes_layout_falls_back_to_the_canonical_record(rtn_store, monkeypatch):
    _, _, store = rtn_store
    expected, _ = build_linears(store.read(1, Precision.INT4, CPU), CPU)
    monkeypatch.setattr(host_store, "cpu_layout", lambda: "cpu:torch-9.9:AVX512:inner1:0")
    stored = store.read(1, Precision.INT4, CPU)
    assert all(isinstance(r, Int4Weight) for r in stored.linears.values())
    linears, _ = build_linears(stored, CPU)  # packed here, at load
    for name in LINEAR_NAMES:
        same_linear(linears[name], expected[name], linears[name].in_features)


def test_the_layout_is_part_of_the_fingerprint(rtn_store, monkeypatch):
    _, spec, _ = rtn_store
    before = store_builder.fingerprint(spec, BuildPlan("rtn"))
    monkeypatch.setattr(store_builder, "cpu_layout", lambda: "cpu:torch-9.9:AVX512:inner1:0")
    assert store_builder.fingerprint(spec, BuildPlan("rtn")) != before
    int8_only = StoreSpec(**{**spec.__dict__, "ladder": (Precision.INT8,)})
    assert store_builder.fingerprint(int8_only, BuildPlan("rtn")) == store_builder.fingerprint(int8_only, BuildPlan("rtn"))


def test_swap_down_packs_nothing_and_restore_is_bit_identical(tiny_model_dir, tmp_path, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="fp32", memory_budget="32MiB", max_model_len=64,
                                    block_size=4, reserve="1MiB", seed=0, cache_dir=str(tmp_path),
                                    calibration="none"))
    layer = engine.model.layers[2]
    original = {n: lin.weight.clone() for n, lin in layer.get_linears().items()}
    original.update({n: w.clone() for n, w in layer.get_norm_weights().items()})

    def no_packing(*_args):
        raise AssertionError("a swap-down from the host store re-packed INT4 codes")
    monkeypatch.setattr(int4_kernel, "_pack_codes", no_packing)
    assert engine.apply(SwapLayer(2, Precision.INT4)).status == "done"
    assert {lin.backend for lin in layer.get_linears().values()} == {"cpu"}
    engine.check_integrity()
    assert engine.apply(RestoreLayer(2)).status == "done"
    now = {n: lin.weight for n, lin in layer.get_linears().items()}
    now.update(layer.get_norm_weights())
    assert now.keys() == original.keys() and all(torch.equal(now[k], original[k]) for k in original)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reads_canonical_records_and_packs_them_there(rtn_store):
    _, _, store = rtn_store
    cuda = torch.device("cuda")
    stored = store.read(0, Precision.INT4, cuda)  # the store holds the CPU layout only: CUDA packs at load
    assert all(isinstance(r, Int4Weight) and r.qweight.is_cuda for r in stored.linears.values())
    linears, norms = build_linears(stored, cuda)
    reference = store.read(0, Precision.INT4)
    for name, lin in linears.items():
        assert lin.packed.is_cuda and lin.layout == int4_kernel.kernel_layout(cuda, lin.out_features, lin.in_features, 64)
        assert torch.equal(lin.codes().cpu(), reference.linears[name].codes())
    assert all(t.is_cuda for t in norms.values())
