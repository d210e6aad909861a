"""PackedStore: swaps and restores map each variant in its in-memory form (no packing, no copy), and the
round trips stay bit-identical; a layer missing from it is read from the host store as before."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import mkldnn_blob_reason
from engine.layers import packed as packed_module
from engine.layers.packed import PackedGroup, PackedLinear, packing_available
from engine.morph.actions import RestoreLayer, SwapLayer
from engine.morph.layer_swapper import build_linears
from engine.morph.packed_store import layer_file
from engine.precision import Precision, torch_dtype
from engine.quant.int4 import Int4Linear
from tests.morph_helpers import engine_for, one_thread  # noqa: F401 (one_thread is a fixture)
from tests.test_layer_swapper import current_tensors, original_tensors

pytestmark = pytest.mark.usefixtures("one_thread")
PACKED_DTYPES = [p.value for p in (Precision.BF16, Precision.FP32) if packing_available(torch_dtype(p), "cpu")]
needs_packing = pytest.mark.skipif(not PACKED_DTYPES or mkldnn_blob_reason() is not None,
                                   reason="this CPU packs no full-precision dtype, or the compiled kernels are not built")
by_dtype = pytest.mark.parametrize("dtype", PACKED_DTYPES or ["bf16"])


@needs_packing
@by_dtype
def test_restore_maps_the_packed_layer_and_packs_nothing(tiny_model_dir, tmp_path, monkeypatch, dtype):
    engine = engine_for(tiny_model_dir, tmp_path, dtype=dtype)
    originals = original_tensors(engine, 1)
    fresh = {id(lin.group): lin.group.to_blob()[0] for lin in engine.model.layers[1].get_linears().values()}
    swapper = engine.morph_executor.swapper
    assert swapper.packed is not None and swapper.packed.has(1, Precision(dtype))

    def no_packing(*args, **kwargs):
        raise AssertionError("a restore from the packed store must not pack")
    for _ in range(2):  # two round trips: the second restore maps the file again
        assert engine.apply(SwapLayer(1, Precision.INT4)).status == "done"
        monkeypatch.setattr(packed_module.PackedGroup, "__init__", no_packing)
        assert engine.apply(RestoreLayer(1)).status == "done"
        monkeypatch.undo()
        layer = engine.model.layers[1]
        groups = {id(lin.group): lin.group for lin in layer.get_linears().values()}
        assert all(isinstance(lin, PackedLinear) for lin in layer.get_linears().values())
        assert all(g._blob is not None for g in groups.values())  # views of the mapped file
        # the mapped bytes are the bytes packing the original weights gives
        assert sorted(b.numel() for b in fresh.values()) == sorted(g._blob.numel() for g in groups.values())
        assert all(any(torch.equal(g._blob, b) for b in fresh.values()) for g in groups.values())
        for name, t in current_tensors(engine, 1).items():
            assert torch.equal(t, originals[name]), name
        assert engine.ledger.layer_weights(1) == layer.weight_bytes() == sum(g.nbytes() for g in groups.values())
        engine.check_integrity()


@needs_packing
@by_dtype
def test_a_restored_group_computes_what_a_freshly_packed_one_does(tiny_model_dir, tmp_path, dtype):
    engine = engine_for(tiny_model_dir, tmp_path, dtype=dtype)
    engine.apply(SwapLayer(2, Precision.INT4))
    engine.apply(RestoreLayer(2))
    groups = {id(l.group): l.group for l in engine.model.layers[2].get_linears().values()}
    for group in groups.values():
        x = torch.randn(7, group.in_features, dtype=group.dtype)
        assert torch.equal(group(x), PackedGroup(group.plain_rows(0, group.out_features), group.bias)(x))


def test_int4_swap_down_maps_the_kernel_layout_and_fuses_without_copying(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    swapper = engine.morph_executor.swapper
    assert swapper.packed is not None and swapper.packed.has(2, Precision.INT4)
    assert engine.apply(SwapLayer(2, Precision.INT4)).status == "done"
    layer = engine.model.layers[2]
    mapped = layer.get_linears()
    from_host = build_linears(swapper.store.read(2, Precision.INT4, "cpu"), torch.device("cpu"))[0]
    for name, lin in mapped.items():
        assert isinstance(lin, Int4Linear)
        assert torch.equal(lin.packed, from_host[name].packed), name
        assert torch.equal(lin.scales_and_zeros, from_host[name].scales_and_zeros), name
    if layer._gate_up is not None:  # gate/up fused: the fused codes are the members' own memory
        assert layer._gate_up.weight.data_ptr() == mapped["gate_proj"].packed.data_ptr()
    x = torch.randn(5, engine.model_config.hidden_size)
    for name in ("q_proj", "gate_proj"):
        assert torch.equal(mapped[name](x), from_host[name](x))
    assert engine.ledger.layer_weights(2) == engine.model.layer_weight_bytes(2) == resident_bytes(layer)
    mapped_file = layer_file(swapper.packed.folder, 2, Precision.INT4).stat().st_size
    norms = sum(t.nbytes for t in layer.get_norm_weights().values())  # counted with the base weights
    assert mapped_file - 3 * 4096 <= engine.ledger.layer_weights(2) + norms <= mapped_file  # the map is all counted
    engine.check_integrity()


def resident_bytes(layer) -> int:
    """Bytes spanned by every tensor the layer's linears and fused calls hold (overlaps counted once):
    equal to the ledger's figure only if no member keeps a second copy beside a fused one."""
    tensors = [t for lin in layer.get_linears().values() for t in lin.buffers()]
    for fused in (layer._qkv, layer._gate_up):
        if fused is not None:
            tensors += [t for t in (fused.weight, fused.scales, fused.bias) if t is not None]
    spans = sorted((t.data_ptr(), t.data_ptr() + (t.nbytes if t.is_contiguous()
                    else (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()))
                   for t in tensors if t.numel())
    total, end = 0, 0
    for lo, hi in spans:
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total


def test_a_variant_missing_from_the_packed_store_is_read_from_the_host_store(tiny_model_dir, tmp_path):
    engine = engine_for(tiny_model_dir, tmp_path)
    swapper = engine.morph_executor.swapper
    layer_file(swapper.packed.folder, 0, Precision.INT4).unlink()
    assert not swapper.packed.has(0, Precision.INT4)
    originals = original_tensors(engine, 0)
    assert engine.apply(SwapLayer(0, Precision.INT4)).status == "done"
    assert engine.model.layers[0].q_proj.precision == Precision.INT4
    assert engine.apply(RestoreLayer(0)).status == "done"
    assert all(torch.equal(t, originals[n]) for n, t in current_tensors(engine, 0).items())
    engine.check_integrity()


def test_an_unwritable_packed_store_leaves_swaps_to_the_host_store(tiny_model_dir, tmp_path, monkeypatch):
    from engine.errors import ModelLoadError
    from engine.morph import packed_store

    def refuse(*args, **kwargs):
        raise ModelLoadError("cannot write the packed layers (read-only cache)")
    monkeypatch.setattr(packed_store, "exclusive_build", refuse)
    engine = engine_for(tiny_model_dir, tmp_path)
    assert engine.morph_executor.swapper.packed is None
    originals = original_tensors(engine, 1)
    assert engine.apply(SwapLayer(1, Precision.INT4)).status == "done"
    assert engine.apply(RestoreLayer(1)).status == "done"
    assert all(torch.equal(t, originals[n]) for n, t in current_tensors(engine, 1).items())
    engine.check_integrity()
