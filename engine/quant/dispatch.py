"""Which CPU matmul the quantized linears use, by the step's row count: one process-wide record.

Eligible CPU INT4 weights (int4_kernel.amx_eligible) go to the engine's tile op from `int4_min_rows` rows up
(engine/kernels/int4_amx.cpp with AMX, int4_avx512.cpp on an AVX512-BF16 CPU without it), torch's `_weight_int4pack_mm_for_cpu` below; eligible CPU INT8 weights
(int8.int8_amx_eligible) to the INT8 tile op from `int8_min_rows` up (engine/kernels/int8_amx.cpp with
AMX-INT8, int8_avx512.cpp on an AVX512-BF16 CPU without it), torch's `_weight_int8pack_mm` below. None =
never the tile op. The two kernels of a rung round differently, so
a threshold above 1 lets a request's output depend on the step's row count (1 = exact batch invariance).
Eligible AVX2-layout INT4 weights (a CPU without AVX-512) go to the engine's fp32 AVX2 op at every row
count while `int4_avx2` is set (one kernel: batch-invariant).

Process-wide like torch's thread count: the engine sets it from EngineConfig.int4_amx_min_rows ('auto'
resolved per tile op by int4_kernel.resolve_int4_min_rows) and int8_amx_min_rows when it builds
(engine_builder.py); benchmarks and tests change it with
`update_amx_dispatch` and put the previous record back with `set_amx_dispatch`.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AmxDispatch:
    int4_min_rows: int | None = None  # rows from which eligible CPU INT4 matmuls use the tile op; None = never
    int8_min_rows: int | None = None  # likewise for INT8
    int4_avx2: bool = True  # eligible CPU INT4 weights (int4_kernel.avx2_eligible) use the engine's fp32 AVX2 op
    # (engine/kernels/int4_avx2.cpp) at every row count; False = torch's int4pack kernel in bf16 (benchmarks)

    def __post_init__(self):
        for name in ("int4_min_rows", "int8_min_rows"):
            rows = getattr(self, name)
            if rows is not None and rows < 1:
                raise ValueError(f"{name} must be >= 1 or None (never), got {rows}")


_current = AmxDispatch()


def amx_dispatch() -> AmxDispatch:
    """The record the quantized matmuls read on every call."""
    return _current


def set_amx_dispatch(dispatch: AmxDispatch) -> AmxDispatch:
    """Install `dispatch`; returns the record it replaces."""
    global _current
    previous, _current = _current, dispatch
    return previous


def update_amx_dispatch(**changes: int | bool | None) -> AmxDispatch:
    """Change some fields (int4_min_rows=..., int8_min_rows=..., int4_avx2=...); returns the record it replaces."""
    return set_amx_dispatch(dataclasses.replace(_current, **changes))
