"""ops/bench/quant_kernels: every candidate computes the same linear (within its quantization error) and the
report has what the publication needs; the engine's INT4 and INT8 AMX ops (built once by `make kernels`) are
candidates where the library is built and the CPU has AMX-BF16 (else skipped, saying why), its INT4 / INT8 tile ops
(AMX's or AVX512-BF16's) wherever either runs (tests/test_int4_tile_op.py, tests/test_int8_amx.py and
tests/test_int8_avx512.py test the ops themselves)."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import int4_amx_reason, int8_amx_reason
from engine.quant.int4_kernel import int4_tile_op
from engine.quant.int8 import int8_rows_op, int8_tile_op
from ops.bench import quant_kernels as qk

SMALL = [(128, 192)]  # in x out: 2 groups of 64, 3 column blocks of 64
ENGINE = ({"bf16_engine"} | ({"int4_tile"} if int4_tile_op() is not None else set())  # the engine's own paths
          | ({"int8_tile"} if int8_tile_op() is not None else set())
          | ({"int8_rows"} if int8_rows_op() is not None else set()))
_no_amx = int4_amx_reason() or int8_amx_reason()
needs_amx = pytest.mark.skipif(_no_amx is not None, reason=f"AMX ops: {_no_amx}")
needs_bf16 = pytest.mark.skipif(qk.baseline_reason() is not None, reason=f"{qk.baseline_reason()}")


def _check_cells(cells: list[dict], names: set[str]) -> None:
    for cell in cells:
        assert set(cell["min_ms"]) == names
        assert cell["min_ratio_to_bf16"][qk.BASELINE] == 1.0
        err = cell["rel_error"]
        assert err[qk.BASELINE] < 0.01 and err.get("bf16_plain", 0.0) < 0.01
        assert err.get("int8_pack_mm", 0.0) < 0.03 and err.get("int8_onednn_dynamic", 0.0) < 0.05
        int8 = {"int8_pack_mm", "int8_onednn_dynamic", "int8_amx", "int8_tile", "int8_rows"}
        assert all(err.get(name, 0.0) < 0.03 for name in int8 - {"int8_onednn_dynamic"})
        assert err.get("bf16_engine", 0.0) < 0.01
        for name in names - {qk.BASELINE, "bf16_plain", "bf16_engine"} - int8:
            assert err[name] < 0.25, (name, err[name])  # INT4 RTN on Gaussian weights: ~0.1


@needs_bf16
def test_candidates_agree_and_report_ratios():
    torch.manual_seed(0)
    cells = qk.run([1, 5], rounds=2, inner=1, copies=2, amx=False, shapes=SMALL)
    assert [(c["in"], c["out"], c["rows"]) for c in cells] == [(128, 192, 1), (128, 192, 5)]
    _check_cells(cells, {qk.BASELINE, "bf16_plain", "int4_tinygemm", "int4_tinygemm_g32", "int8_pack_mm",
                         "int4_dequant_linear", "int8_onednn_dynamic"} | ENGINE)


@needs_amx
@needs_bf16
def test_amx_candidate_is_timed_and_agrees():
    torch.manual_seed(0)
    cells = qk.run([3], rounds=1, inner=1, copies=1, amx=True, shapes=SMALL)
    _check_cells(cells, {qk.BASELINE, "bf16_plain", "int4_tinygemm", "int4_tinygemm_g32", "int8_pack_mm",
                         "int4_dequant_linear", "int8_onednn_dynamic", "int4_amx", "int8_amx"} | ENGINE)


@needs_bf16
def test_candidates_can_be_chosen():
    torch.manual_seed(0)
    cells = qk.run([2], rounds=1, inner=1, copies=1, amx=False, shapes=SMALL, only={"int8_pack_mm"})
    _check_cells(cells, {qk.BASELINE, "int8_pack_mm"})


@pytest.mark.skipif(qk.baseline_reason() is None, reason="this CPU packs bf16: the benchmark runs")
def test_without_native_bf16_it_says_what_to_run_instead():
    with pytest.raises(SystemExit, match="decode_step"):
        qk.run([1], rounds=1, inner=1, copies=1, amx=False, shapes=SMALL)
