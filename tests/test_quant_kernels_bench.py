"""ops/bench/quant_kernels: every candidate computes the same linear (within its quantization error) and the
report has what the publication needs. The engine's INT4 AMX op (engine/kernels/int4_amx.cpp, built once by
`make kernels`) against torch's int4pack kernel, and Int4Linear / the fused INT4 call dispatching between
them by row count, where the library is built and the CPU has AMX-BF16 (else skipped, saying why)."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import int4_amx_op, int4_amx_reason
from engine.quant.fused import fuse_quantized
from engine.quant.int4_kernel import amx_min_rows, set_amx_min_rows
from ops.bench import quant_kernels as qk

SMALL = [(128, 192)]  # in x out: 2 groups of 64, 3 column blocks of 64
needs_amx = pytest.mark.skipif(int4_amx_reason() is not None, reason=f"INT4 AMX op: {int4_amx_reason()}")


def _check_cells(cells: list[dict], names: set[str]) -> None:
    for cell in cells:
        assert set(cell["min_ms"]) == names
        assert cell["min_ratio_to_bf16"][qk.BASELINE] == 1.0
        err = cell["rel_error"]
        assert err[qk.BASELINE] < 0.01 and err["bf16_plain"] < 0.01
        assert err["int8_pack_mm"] < 0.03 and err["int8_onednn_dynamic"] < 0.05
        for name in names - {qk.BASELINE, "bf16_plain", "int8_pack_mm", "int8_onednn_dynamic"}:
            assert err[name] < 0.25, (name, err[name])  # INT4 RTN on Gaussian weights: ~0.1


def test_candidates_agree_and_report_ratios():
    torch.manual_seed(0)
    cells = qk.run([1, 5], rounds=2, inner=1, copies=2, amx=False, shapes=SMALL)
    assert [(c["in"], c["out"], c["rows"]) for c in cells] == [(128, 192, 1), (128, 192, 5)]
    _check_cells(cells, {qk.BASELINE, "bf16_plain", "int4_tinygemm", "int4_tinygemm_g32", "int8_pack_mm",
                         "int4_dequant_linear", "int8_onednn_dynamic"})


@pytest.fixture
def threshold():
    """Restores the process-wide INT4 dispatch threshold a test changes."""
    before = amx_min_rows()
    yield set_amx_min_rows
    set_amx_min_rows(before)


@needs_amx
def test_amx_op_matches_the_int4_kernel_and_is_row_invariant(threshold):
    threshold(None)
    torch.manual_seed(0)
    w = torch.randn(192, 128) * 0.05
    i4 = qk.Int4Linear(qk.quantize_int4(w, 64))
    assert i4.amx
    op = int4_amx_op()
    x = torch.randn(130, 128).to(torch.bfloat16)
    full = op(x, i4.packed, i4.group_size, i4.scales_and_zeros)
    for m in (1, 3, 17, 130):  # 130 > one 128-row brgemm chunk
        ref = i4(x[:m]).float()  # torch's kernel (threshold never)
        y = op(x[:m], i4.packed, i4.group_size, i4.scales_and_zeros)
        assert y.shape == (m, 192)
        assert (y.float() - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
        assert torch.equal(y, full[:m])  # a row's output does not depend on the other rows


@needs_amx
def test_linears_dispatch_by_rows(threshold):
    """Below the threshold Int4Linear and the fused q/k/v call are torch's kernel exactly; from it up, the AMX op."""
    torch.manual_seed(1)
    members = [qk.Int4Linear(qk.quantize_int4(torch.randn(n, 128) * 0.05, 64)) for n in (128, 64, 64)]
    x = torch.randn(17, 128).to(torch.bfloat16)
    threshold(None)
    old = [lin(x) for lin in members]
    fused = fuse_quantized(members)
    assert fused is not None and fused.amx
    op = int4_amx_op()
    new = [op(x, lin.packed, lin.group_size, lin.scales_and_zeros.contiguous()) for lin in members]
    threshold(4)
    for m in (1, 3):  # below: torch's kernel, bit-identical
        assert torch.equal(fused(x[:m]), torch.cat([o[:m] for o in old], dim=1))
        assert all(torch.equal(lin(x[:m]), o[:m]) for lin, o in zip(members, old))
    for m in (4, 17):  # from the threshold up: the AMX op, bit-identical to calling it directly
        assert torch.equal(fused(x[:m]), torch.cat([o[:m] for o in new], dim=1))
        assert all(torch.equal(lin(x[:m]), o[:m]) for lin, o in zip(members, new))
