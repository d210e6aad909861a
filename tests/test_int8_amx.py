"""The engine's INT8 AMX op (engine/kernels/int8_amx.cpp, built once by `make kernels`): numerics against the
dequantized reference on the host store's int8 codes, row invariance, which weights it takes, and the
row-count dispatch of Int8Linear and the fused INT8 call (EngineConfig.int8_amx_min_rows). Skipped, saying
why, where the library is not built or the CPU has no AMX-BF16 (AVX2-only CPUs, other torch builds)."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import int8_amx_op, int8_amx_reason
from engine.morph.actions import RestoreLayer, SwapLayer
from engine.precision import Precision
from engine.quant import Int8Linear, quantize_int8
from engine.quant.fused import fuse_quantized
from engine.quant.awq import LayerWeights
from engine.quant.dispatch import amx_dispatch
from tests.morph_helpers import engine_for
from tests.test_engine import generate, mixed_prompts
from tests.kernel_dispatch import assert_dispatch_by_rows

pytestmark = pytest.mark.skipif(int8_amx_reason() is not None, reason=f"INT8 AMX op: {int8_amx_reason()}")
BF16_UNIT = 2.0 ** -8  # relative rounding of one bf16 value


RUNG = "int8"  # the rung whose row threshold the `threshold` fixture (conftest.py) sets


@pytest.mark.parametrize("n, k", [(16, 64), (48, 128), (80, 64), (576, 576), (192, 1536)])
def test_amx_op_matches_the_dequantized_matmul_and_is_row_invariant(n, k):
    gen = torch.Generator().manual_seed(n + k)
    record = quantize_int8(torch.randn(n, k, generator=gen) * 0.05)
    op = int8_amx_op()
    x = torch.randn(70, k, generator=gen).to(torch.bfloat16)
    full = op(x, record.qweight, record.scales)
    w = record.dequantize()
    for m in (1, 3, 16, 17, 33, 70):  # odd counts, one and several 16-row tiles, > one 32-row pass
        y = op(x[:m], record.qweight, record.scales)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        ref = x[:m].float() @ w.t()
        # exact integer products; x on a 16-bit grid per row (<= max|x| / 65024 each) and the output's bf16 rounding
        grid = x[:m].float().abs().amax(dim=1, keepdim=True) / 65024 * w.abs().sum(dim=1)
        magnitude = x[:m].float().abs() @ w.abs().t()
        assert bool(((y.float() - ref).abs() <= BF16_UNIT * magnitude + grid + 1e-6).all())
        assert torch.equal(y, full[:m])  # a row's output does not depend on the other rows


def test_amx_op_rejects_shapes_it_cannot_tile():
    record = quantize_int8(torch.randn(24, 64))
    with pytest.raises(RuntimeError, match="N % 16 == 0 and K % 64 == 0"):
        int8_amx_op()(torch.randn(2, 64).to(torch.bfloat16), record.qweight, record.scales)


def test_only_tile_shaped_weights_are_eligible():
    assert Int8Linear(quantize_int8(torch.randn(48, 64))).amx
    assert not Int8Linear(quantize_int8(torch.randn(24, 64))).amx  # rows not a multiple of 16
    assert not Int8Linear(quantize_int8(torch.randn(48, 96))).amx  # columns not a multiple of 64


def test_linears_dispatch_by_rows(threshold):
    """Below the threshold Int8Linear and the fused q/k/v call are torch's kernel exactly; from it up, the AMX op."""
    gen = torch.Generator().manual_seed(1)
    members = [Int8Linear(quantize_int8(torch.randn(n, 128, generator=gen) * 0.05)) for n in (128, 64, 64)]
    x = torch.randn(17, 128, generator=gen).to(torch.bfloat16)
    threshold(None)
    old = [lin(x) for lin in members]
    assert all(torch.equal(o, torch.ops.aten._weight_int8pack_mm(x, lin.qweight, lin.scales.bfloat16()))
               for lin, o in zip(members, old))
    fused = fuse_quantized(members)
    assert fused is not None and fused.amx
    op = int8_amx_op()
    new = [op(x, lin.qweight, lin.scales) for lin in members]
    threshold(4)
    assert_dispatch_by_rows(fused, members, x, old, new)
    ineligible = Int8Linear(quantize_int8(torch.randn(24, 128, generator=gen)))
    assert torch.equal(ineligible(x), torch.ops.aten._weight_int8pack_mm(x, ineligible.qweight, ineligible.scales.bfloat16()))


def test_int8_layers_are_batch_invariant_with_amx_from_one_row(tiny_model_dir, tmp_path, threshold):
    """int8_amx_min_rows=1: every INT8 matmul is the row-invariant AMX op, so alone == batched exactly; a
    restore gives back the full-precision layer bit for bit."""
    engine = engine_for(tiny_model_dir, tmp_path, int8_amx_min_rows=1)
    assert amx_dispatch().int8_min_rows == 1
    prompts = mixed_prompts(n=8, seed=7)
    before = generate(engine, prompts)
    for i in range(engine.model.config.num_layers):
        assert engine.apply(SwapLayer(i, Precision.INT8)).status == "done"
    assert engine.model.layers[0].down_proj.amx  # 128 -> 64: tile-shaped
    alone = {rid: generate(engine, {rid: p})[rid] for rid, p in prompts.items()}
    assert generate(engine, prompts) == alone
    for i in range(engine.model.config.num_layers):
        assert engine.apply(RestoreLayer(i)).status == "done"
    assert generate(engine, prompts) == before


def test_int8_model_keeps_its_quality_on_the_amx_kernel(threshold):
    """The real default model with all 30 layers INT8 (RTN, as the host store builds them). Per linear, on the
    model's own weights and its own activations (layer 5's inputs on real text), the AMX op is closer to the
    exact dequantized product than torch's int8pack kernel (x on a 16-bit grid per row, fp32 scaling; torch
    rounds x . q and the scale to bf16). On real text (ShareGPT turns) its perplexity stays within 1% of full
    precision and of torch's kernel, and its next-token choices agree with full precision's: the accuracy
    rung is unchanged by the kernel swap (greedy tokens can still differ where two logits nearly tie)."""
    from engine.loader import load_model
    from engine.morph.calibration import sharegpt_text
    from engine.morph.profiler import LayerSwitch
    from engine.quant.awq import quantize_layer_rtn
    from ops.quality.perplexity import perplexity

    loaded = load_model("default", torch.bfloat16)
    model = loaded.model
    ids = loaded.tokenizer.encode(sharegpt_text(6000))[:1024]
    for name, x in _layer_inputs(model, 5, ids[:64]).items():
        record = quantize_int8(LayerWeights.of_layer(model.layers[5]).linears[name])
        exact = x.double() @ (record.qweight.double() * record.scales.double()[:, None]).t()
        amx = int8_amx_op()(x, record.qweight, record.scales).double()
        aten = torch.ops.aten._weight_int8pack_mm(x, record.qweight, record.scales.bfloat16()).double()
        assert (amx - exact).norm() < (aten - exact).norm(), name
    window = 256  # rows per linear call: far above any threshold
    layers = range(model.config.num_layers)
    switch = LayerSwitch(model, {i: quantize_layer_rtn(LayerWeights.of_layer(model.layers[i]), Precision.INT8)
                                 for i in layers})
    with torch.inference_mode():
        full_ppl, full_top1 = perplexity(model, ids, window=window), _top1(model, ids[:window])
        for i in layers:
            switch.quantize(i)
        assert model.layers[0].down_proj.amx
        threshold(None)  # torch's kernel only
        torch_ppl = perplexity(model, ids, window=window)
        threshold(1)  # the AMX op for every call
        amx_ppl, amx_top1 = perplexity(model, ids, window=window), _top1(model, ids[:window])
    assert amx_ppl == pytest.approx(torch_ppl, rel=0.01) and amx_ppl == pytest.approx(full_ppl, rel=0.01)
    assert (amx_top1 == full_top1).float().mean().item() >= 0.93


def _top1(model, ids: list[int]) -> torch.Tensor:
    """The greedy next token at every position of one prefill of `ids`."""
    from engine.morph.calibration import DenseRunner
    runner = DenseRunner(model, 1, len(ids))
    return model.compute_logits(runner.run_layers(runner.embed(torch.tensor([ids])), 0)).argmax(-1)


def _layer_inputs(model, i: int, ids: list[int]) -> dict[str, torch.Tensor]:
    """What each linear of layer i reads when the full-precision model runs `ids` (bf16 [T, in])."""
    import torch.nn.functional as F
    from engine.morph.calibration import DenseRunner
    from engine.quant.awq import record_calibration
    runner = DenseRunner(model, 1, len(ids))
    layer, eps = model.layers[i], model.config.rms_norm_eps
    with torch.inference_mode(), record_calibration(layer) as calib:
        runner.run_layers(runner.embed(torch.tensor([ids])), 0, i + 1)
    norms, linears = layer.get_norm_weights(), LayerWeights.of_layer(layer).linears
    attn_in = F.rms_norm(calib[0].hidden.float(), (model.config.hidden_size,), norms["input_layernorm"].float(), eps)
    mlp_in = F.rms_norm(calib[0].residual.float(), (model.config.hidden_size,), norms["post_attention_layernorm"].float(), eps)
    down_in = F.silu(mlp_in @ linears["gate_proj"].float().t()) * (mlp_in @ linears["up_proj"].float().t())
    inputs = {"q_proj": attn_in, "k_proj": attn_in, "v_proj": attn_in, "o_proj": calib[0].attn_out.float(),
              "gate_proj": mlp_in, "up_proj": mlp_in, "down_proj": down_in}
    return {name: x.to(torch.bfloat16) for name, x in inputs.items()}
