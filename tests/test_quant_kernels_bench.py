"""ops/bench/quant_kernels: every candidate computes the same linear (within its quantization error) and the
report has what the publication needs; the AMX candidate is built and checked where the CPU has AMX."""
from __future__ import annotations

import shutil

import pytest
import torch

from ops.bench import quant_kernels as qk

SMALL = [(128, 192)]  # in x out: 2 groups of 64, 3 column blocks of 64


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


@pytest.mark.skipif(shutil.which("g++") is None or not torch.cpu._is_amx_tile_supported(),
                    reason="the AMX candidate needs g++ and a CPU with AMX")
def test_amx_candidate_matches_the_int4_kernel():
    qk.build_amx_candidate()
    torch.manual_seed(0)
    w = torch.randn(192, 128) * 0.05
    i4 = qk.Int4Linear(qk.quantize_int4(w, 64))
    for m in (1, 3, 17, 130):  # 130 > one 128-row brgemm chunk
        x = torch.randn(m, 128).to(torch.bfloat16)
        ref = i4(x).float()
        for op in (torch.ops.morphserve_bench.int4_amx_mm, torch.ops.morphserve_bench.int4_amx_codes_mm):
            y = op(x, i4.packed, i4.group_size, i4.scales_and_zeros).float()
            assert y.shape == (m, 192)
            assert (y - ref).abs().max().item() <= 0.02 * ref.abs().max().item()
