"""A decoder layer runs q/k/v and gate/up as one matmul each when they are all DenseLinear: the fused
weights share the linears' storage (no extra bytes, bit-identical values), a restore of saved linears
reuses that storage without a copy, and a quantized or mixed group falls back to separate calls."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import DenseLinear, fuse_dense, tensor_nbytes
from test_model_parity import load_model
from test_model_runner import A, A_DEC, B, B_DEC, copy_layer_linears, make_runner, step


class Wrapped(nn.Module):
    """A linear that is not a DenseLinear (as a quantized one is not), with the same math."""

    def __init__(self, dense: DenseLinear):
        super().__init__()
        self.dense, self.precision = dense, dense.precision
        self.in_features, self.out_features = dense.in_features, dense.out_features

    def nbytes(self) -> int:
        return self.dense.nbytes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


def logits(model) -> torch.Tensor:
    runner = make_runner(model, linears="plain")  # the DenseLinear fusion these tests are about
    first = step(runner, A, B)
    return torch.cat([first, step(runner, A_DEC, B_DEC)])


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_loaded_layer_is_fused_over_the_linears_own_storage(tiny_model_dir):
    model = load_model(tiny_model_dir)
    for layer in model.layers:
        lin = layer.get_linears()
        qkv, gate_up = layer._qkv[0], layer._gate_up[0]
        assert {storage_of(lin[n].weight) for n in ("q_proj", "k_proj", "v_proj")} == {storage_of(qkv)}
        assert {storage_of(lin[n].weight) for n in ("gate_proj", "up_proj")} == {storage_of(gate_up)}
        # No hidden copy: the fused tensors are exactly the bytes the ledger counts for those linears.
        assert tensor_nbytes(qkv) == sum(lin[n].nbytes() for n in ("q_proj", "k_proj", "v_proj"))
        assert qkv.untyped_storage().nbytes() == tensor_nbytes(qkv)
        assert tensor_nbytes(gate_up) == lin["gate_proj"].nbytes() + lin["up_proj"].nbytes()


def test_restoring_saved_linears_reuses_their_storage_bit_identically(tiny_model_dir):
    model = load_model(tiny_model_dir)
    before = logits(model)
    layer = model.layers[1]
    saved = layer.get_linears()
    values = {n: lin.weight.clone() for n, lin in saved.items()}
    fused_ptr = storage_of(layer._qkv[0])
    layer.set_weights(copy_layer_linears(layer, 0.5))
    assert storage_of(layer._qkv[0]) != fused_ptr
    layer.set_weights(saved)
    assert storage_of(layer._qkv[0]) == fused_ptr  # reused, not copied
    assert all(torch.equal(layer.get_linears()[n].weight, values[n]) for n in values)
    assert torch.equal(logits(model), before)


def test_separate_tensors_are_fused_with_the_same_values(tiny_model_dir):
    model = load_model(tiny_model_dir)
    before = logits(model)
    layer = model.layers[0]
    fresh = copy_layer_linears(layer)
    expected = {n: lin.weight.clone() for n, lin in fresh.items()}
    layer.set_weights(fresh)
    now = layer.get_linears()
    assert all(now[n] is fresh[n] and torch.equal(now[n].weight, expected[n]) for n in expected)
    assert storage_of(now["q_proj"].weight) == storage_of(layer._qkv[0])
    torch.testing.assert_close(logits(model), before, rtol=1e-5, atol=1e-5)


def test_a_mixed_group_runs_unfused_with_the_same_result(tiny_model_dir):
    model = load_model(tiny_model_dir)
    before = logits(model)
    layer = model.layers[0]
    mixed = copy_layer_linears(layer)
    mixed["k_proj"], mixed["up_proj"] = Wrapped(mixed["k_proj"]), Wrapped(mixed["up_proj"])
    layer.set_weights(mixed)
    assert layer._qkv is None and layer._gate_up is None
    torch.testing.assert_close(logits(model), before, rtol=1e-5, atol=1e-5)


def test_fuse_dense_refuses_what_it_cannot_fuse():
    a = DenseLinear(torch.randn(4, 3))
    assert fuse_dense([a, DenseLinear(torch.randn(2, 5))]) is None  # different in_features
    assert fuse_dense([a, DenseLinear(torch.randn(2, 3, dtype=torch.bfloat16))]) is None
    assert fuse_dense([a, DenseLinear(torch.randn(2, 3), torch.randn(2))]) is None  # bias on one only
    assert fuse_dense([a, Wrapped(DenseLinear(torch.randn(2, 3)))]) is None


def test_residual_adds_fused_into_the_norms_change_no_bit(tiny_model_dir):
    # Transformer.forward runs each layer's forward_residual (the adds inside the next norm); with
    # fuse_residual off it calls the layers as modules (what AWQ calibration hooks). Same logits.
    model = load_model(tiny_model_dir)
    fused = logits(model)
    for layer in model.layers:
        layer.fuse_residual = False
    assert torch.equal(logits(model), fused)
