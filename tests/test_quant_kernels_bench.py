"""ops/bench/quant_kernels: every candidate computes the same linear (within its quantization error) and the
report has what the publication needs; the engine's INT4 AMX op (built once by `make kernels`) is a candidate
where the library is built and the CPU has AMX-BF16 (else skipped, saying why; tests/test_int4_amx.py
tests the op itself)."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import int4_amx_reason
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


@needs_amx
def test_amx_candidate_is_timed_and_agrees():
    torch.manual_seed(0)
    cells = qk.run([3], rounds=1, inner=1, copies=1, amx=True, shapes=SMALL)
    _check_cells(cells, {qk.BASELINE, "bf16_plain", "int4_tinygemm", "int4_tinygemm_g32", "int8_pack_mm",
                         "int4_dequant_linear", "int8_onednn_dynamic", "int4_amx"})
