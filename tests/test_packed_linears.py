"""Pre-packed (oneDNN) linears, in every full-precision dtype this CPU packs (bf16 with native bf16,
fp32 anywhere): the outputs of F.linear (bit for bit in bf16, where F.linear is oneDNN too; within float
rounding in fp32, where it is MKL), the same bytes in the ledger, and a swap down + restore of a packed
layer is a bit-identical round trip that repacks on install."""
from __future__ import annotations

import pytest
import torch

from engine.layers.linear import DenseLinear
from engine.layers.packed import PackedLinear, packing_available, vnni_op
from engine.loader import load_model
from engine.morph.actions import RestoreLayer, SwapLayer
from engine.precision import Precision, torch_dtype
from engine.sampling_params import SamplingParams
from tests.morph_helpers import engine_for, one_thread  # noqa: F401 (one_thread is a fixture)
from tests.conftest import make_tiny_hf_model
from tests.test_layer_swapper import current_tensors, original_tensors

PACKED_DTYPES = [p for p in (Precision.BF16, Precision.FP32) if packing_available(torch_dtype(p), "cpu")]
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not PACKED_DTYPES, reason="this CPU packs no full-precision dtype (no oneDNN)")]
by_dtype = pytest.mark.parametrize("dtype", [p.value for p in PACKED_DTYPES])
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13], "c": list(range(20, 37))}


def generate(engine) -> dict[str, list[int]]:
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, GREEDY)
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.token_ids)
    return tokens




def assert_same(got, want, dtype: str) -> None:
    """bf16: bit for bit; fp32: within float rounding (oneDNN and MKL sum in different orders)."""
    if dtype == "bf16":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _dense(lin):
    return DenseLinear(lin.weight, None if lin.bias is None else lin.bias.clone())


@by_dtype
def test_packed_model_matches_plain_and_counts_the_same_bytes(tiny_model_dir, tmp_path, dtype):
    engine = engine_for(tiny_model_dir, tmp_path, dtype=dtype, enable_morphing=False)
    layer = engine.model.layers[0]
    linears = layer.get_linears()
    assert all(isinstance(l, PackedLinear) for l in linears.values())
    # The members of each group sum to exactly the packed tensor's resident bytes.
    groups = {id(l.group): l.group for l in linears.values()}
    assert sum(g.nbytes() for g in groups.values()) == layer.weight_bytes() == engine.ledger.layer_weights(0)
    packed = generate(engine)

    plain_engine = engine_for(tiny_model_dir, tmp_path, dtype=dtype, enable_morphing=False)
    for lyr in plain_engine.model.layers:
        lyr.pack = False
        lyr.set_weights({n: _dense(l) for n, l in lyr.get_linears().items()})
    assert not isinstance(plain_engine.model.layers[0].q_proj, PackedLinear)
    assert generate(plain_engine) == packed
    for lin in linears.values():  # a member alone = F.linear on its rows
        x = torch.randn(5, lin.in_features, dtype=torch_dtype(Precision(dtype)))
        assert_same(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), dtype)


def _plain_base_bytes(model) -> int:
    """base_weight_bytes() of a model with plain tables (no head packed, no copy): the embedding (and an
    untied head), every norm, RoPE."""
    c = model.config
    tables = (1 if c.tie_word_embeddings else 2) * c.vocab_size * c.hidden_size * model.embed_weight.element_size()
    tensors = [model.norm.weight, model.rotary.cos, model.rotary.sin] + \
        [w for layer in model.layers for w in layer.get_norm_weights().values()]
    return tables + sum(t.numel() * t.element_size() for t in tensors)


def _ledger_base(engine) -> int:
    return engine.ledger.weights - sum(engine.ledger.layer_weights(i) for i in range(len(engine.model.layers)))


def _check_head_logits(model, want_weight, dtype) -> None:
    hidden = torch.randn(7, model.config.hidden_size, dtype=torch_dtype(Precision(dtype)))
    normed = model.norm(hidden)
    logits = model.compute_logits(hidden)
    assert_same(logits, torch.nn.functional.linear(normed, want_weight, model.lm_head.bias).float(), dtype)
    assert torch.equal(model.compute_logits(hidden[2:3]), logits[2:3])  # row-invariant


IN_PLACE = "bf16" in [p.value for p in PACKED_DTYPES] and vnni_op() is not None


@pytest.mark.skipif(not IN_PLACE, reason="lm_head packs in place in the vnni32 layout: bf16 with native bf16, kernels built")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_head_packs_in_place_with_the_same_bytes_logits_and_tokens(tmp_path, tied):
    model_dir = make_tiny_hf_model(tmp_path / "model", tie_word_embeddings=tied)
    plain = load_model(str(model_dir), torch.bfloat16, "cpu").model  # never packed: the reference
    engine = engine_for(model_dir, tmp_path / "cache", dtype="bf16", enable_morphing=False, pack_lm_head=True)
    model = engine.model
    assert model.head_packed_in_place and model._head_copy is None  # pack_lm_head: nothing left to copy
    assert isinstance(model.lm_head, PackedLinear) and (model.embed_weight is None) == tied  # no plain table kept
    assert model.base_weight_bytes() == _plain_base_bytes(plain) == _ledger_base(engine)
    want = plain.embed_weight
    head = want if tied else plain.lm_head.weight
    assert torch.equal(model.lm_head.weight, head)  # read back bit-identical
    ids = torch.tensor([0, 31, 32, 255, 7, 7])  # block edges, the last row, a repeat
    assert torch.equal(model.embed(ids), torch.nn.functional.embedding(ids, want))
    assert torch.equal(model.hf_tensors()["model.embed_tokens.weight"], want)
    _check_head_logits(model, head, "bf16")
    packed = generate(engine)
    model.set_head(DenseLinear(model.lm_head.weight, model.lm_head.bias))  # plain again: the same greedy tokens
    assert not model.head_packed_in_place
    assert generate(engine) == packed


@by_dtype
def test_head_copy_gives_the_same_logits_and_is_counted(tiny_model_dir, tmp_path, dtype):
    """pack_lm_head's second copy, where the head cannot pack in place."""
    model = engine_for(tiny_model_dir, tmp_path, dtype=dtype, enable_morphing=False).model
    assert model._head_copy is None
    engine = engine_for(tiny_model_dir, tmp_path, dtype=dtype, enable_morphing=False, pack_lm_head=True)
    model = engine.model
    if model.head_packed_in_place:
        assert model._head_copy is None
        pytest.skip("the head packed in place: no copy to keep (test_head_packs_in_place_...)")
    head = model._head_copy
    assert head is not None  # packed by the builder, before the memory plan
    assert model.base_weight_bytes() == _plain_base_bytes(model) + head.nbytes() == _ledger_base(engine)
    _check_head_logits(model, model.lm_head.weight, dtype)  # the plain head, still kept


@by_dtype
def test_swap_and_restore_of_a_packed_layer_is_bit_identical(tiny_model_dir, tmp_path, dtype):
    engine = engine_for(tiny_model_dir, tmp_path, dtype=dtype)
    originals = original_tensors(engine, 1)
    before = generate(engine)
    down = engine.apply(SwapLayer(1, Precision.INT4))
    assert down.status == "done" and engine.model.layers[1].q_proj.precision == Precision.INT4
    restored = engine.apply(RestoreLayer(1))
    assert restored.status == "done" and restored.weight_bytes_delta == -down.weight_bytes_delta
    layer = engine.model.layers[1]
    assert all(isinstance(l, PackedLinear) for l in layer.get_linears().values())  # packed again on install
    for name, t in current_tensors(engine, 1).items():
        assert t.dtype == originals[name].dtype and torch.equal(t, originals[name]), name
    assert engine.ledger.layer_weights(1) == layer.weight_bytes()
    engine.check_integrity()
    assert generate(engine) == before
