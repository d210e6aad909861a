"""The engine's compiled CPU kernels (torch custom ops in one library built by `make`, see build.py).

`paged_attention_op()` / `causal_attention_op()` / `elementwise_ops()` (`elementwise_ops_for(x)`) /
`int4_amx_op()` / `int4_avx512_op()` / `int4_avx2_op()` / `int8_amx_op()` / `int8_avx512_op()` /
`bf16_amx_op()` / `bf16_avx512_op()` / `argmax_op()` / `kv_write_op()` are the ops, or None when the
library is not built or is older than its sources (the callers then use their torch-only path, and
`available_reason()` says why). Some ops also need CPU features at run time and a library compiled for
them (their sources are empty where the compiler does not target them): the AMX ops (int4_amx.cpp,
int8_amx.cpp, bf16_amx.cpp) need AMX (BF16 for INT4 and bf16 linears, INT8 for INT8; int4_amx.cpp also
AVX512-VBMI, which every AMX CPU has); the prefill attention op (causal_attention.cpp), the bf16 AVX512
linear (bf16_avx512.cpp) and the INT8 AVX512 op (int8_avx512.cpp) need AVX512-BF16; the INT4 AVX512 op
(int4_avx512.cpp) AVX512-BF16 + AVX512-VBMI; the INT4 AVX2 op (int4_avx2.cpp) AVX2 + FMA. The `*_reason()`
of each says why not."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "paged_attention.cpp", HERE / "int4_amx.cpp", HERE / "int4_avx2.cpp", HERE / "int4_avx512.cpp",
           HERE / "mkldnn_blob.cpp", HERE / "int8_amx.cpp", HERE / "fused_elementwise.cpp", HERE / "causal_attention.cpp",
           HERE / "bf16_amx.cpp", HERE / "bf16_avx512.cpp", HERE / "int8_avx512.cpp",
           HERE / "greedy.cpp", HERE / "kv_write.cpp")
HEADERS = (HERE / "simd_math.h", HERE / "amx_tiles.h", HERE / "int4_codes.h", HERE / "bf16_vnni.h")  # included by the sources: a change rebuilds too
LIBRARY = HERE / "_morphserve_kernels.so"
logger = logging.getLogger(__name__)
_state: dict[str, object] = {}


def _load() -> None:
    if "reason" in _state:
        return
    if not LIBRARY.exists():
        _state["reason"] = f"{LIBRARY.name} not built (run `make kernels` or `python -m engine.kernels.build`)"
    elif any(s.exists() and s.stat().st_mtime > LIBRARY.stat().st_mtime for s in SOURCES + HEADERS):
        _state["reason"] = f"{LIBRARY.name} is older than its source (rebuild: `make kernels`)"
    else:
        try:
            torch.ops.load_library(str(LIBRARY))
            _state["reason"] = None
        except OSError as e:  # built for another torch or CPU: say so, fall back
            _state["reason"] = f"{LIBRARY.name} does not load: {e}"
    if _state["reason"]:
        logger.warning("compiled kernels unavailable: %s; using the torch-only paths", _state["reason"])


def paged_attention_op():
    _load()
    return None if _state["reason"] else torch.ops.morphserve.paged_attention


def elementwise_ops():
    """The fused elementwise ops (fused_elementwise.cpp: rms_norm, silu_and_mul, rotary_)
    as the `torch.ops.morphserve` namespace, or None when the library is not loaded."""
    _load()
    return None if _state["reason"] else torch.ops.morphserve


def kv_write_op():
    """`torch.ops.morphserve.write_kv` (kv_write.cpp: a step's K/V rows into their cache slots), or None
    when the library is not loaded."""
    _load()
    return None if _state["reason"] else torch.ops.morphserve.write_kv


def argmax_op():
    """`torch.ops.morphserve.argmax_rows` (greedy.cpp: torch.argmax(dim=-1) of fp32 CPU rows, vectorized),
    or None when the library is not loaded."""
    _load()
    return None if _state["reason"] else torch.ops.morphserve.argmax_rows


def elementwise_ops_for(x: torch.Tensor):
    """elementwise_ops() when they take x (CPU, fp32 or bf16, last dimension contiguous), else None.
    One lookup per call: the layers call this on every step, for every layer."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.stride(-1) != 1:
        return None
    return elementwise_ops()


def available_reason() -> str | None:
    """None when the kernels are loaded, else why not."""
    _load()
    return _state["reason"]  # type: ignore[return-value]


def _cpu_op_reason(op: str, flags: tuple[str, ...], fallback: str, tiles: bool = True) -> str | None:
    """None when `torch.ops.morphserve.<op>` can run here (the CPU has every one of `flags` and, with
    `tiles`, the kernel has granted AMX tile state), else why not (logged once)."""
    if op not in _state:
        from engine.capability import detect_capability  # /proc/cpuinfo flags, cached
        _load()
        have = detect_capability(torch.device("cpu")).cpu_flags
        named = " + ".join(f.upper().replace("_", "-") for f in flags)
        if _state["reason"]:
            _state[op] = _state["reason"]
        elif any(f not in have for f in flags) or (tiles and not torch.cpu._is_amx_tile_supported()):
            _state[op] = f"this CPU has no {named}" + (" (or the kernel has not enabled AMX tiles)" if tiles else "")
        elif not hasattr(torch.ops.morphserve, op):
            _state[op] = f"{LIBRARY.name} was compiled for a CPU without {named}"
        else:
            _state[op] = None
        if _state[op]:
            logger.info("%s unavailable (%s); %s", op, _state[op], fallback)
    return _state[op]  # type: ignore[return-value]


def int4_amx_reason() -> str | None:
    """None when `torch.ops.morphserve.int4_amx_mm` can run here, else why not."""
    return _cpu_op_reason("int4_amx_mm", ("avx512_bf16", "amx_bf16"), "INT4 layers use torch's int4pack kernel")


def mkldnn_blob_reason() -> str | None:
    """None when oneDNN-packed weights can be copied out as bytes and wrapped back (mkldnn_blob.cpp)."""
    _load()
    if _state["reason"]:
        return _state["reason"]  # type: ignore[return-value]
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.morphserve, "mkldnn_from_blob"):
        return "this torch has no oneDNN (mkldnn) backend"
    return None


def int4_amx_op():
    return None if int4_amx_reason() else torch.ops.morphserve.int4_amx_mm


def int4_avx512_reason() -> str | None:
    """None when `torch.ops.morphserve.int4_avx512_mm` (the AVX512 int4pack layout with vdpbf16ps, for CPUs
    with AVX512-BF16 and no AMX) can run here, else why not."""
    return _cpu_op_reason("int4_avx512_mm", ("avx512_bf16", "avx512vbmi"), "INT4 layers use torch's int4pack kernel",
                          tiles=False)


def int4_avx512_op():
    return None if int4_avx512_reason() else torch.ops.morphserve.int4_avx512_mm


def int4_avx2_reason() -> str | None:
    """None when `torch.ops.morphserve.int4_avx2_mm` (fp32 activations, AVX2 int4pack layout) can run here,
    else why not (then INT4 layers use torch's int4pack kernel in bf16)."""
    return _cpu_op_reason("int4_avx2_mm", ("avx2",), "INT4 layers use torch's int4pack kernel", tiles=False)


def int4_avx2_op():
    return None if int4_avx2_reason() else torch.ops.morphserve.int4_avx2_mm


def causal_attention_reason() -> str | None:
    """None when `torch.ops.morphserve.causal_attention` (bf16 prefill attention through ATen's brgemm) can
    run here, else why not. It needs AVX512-BF16, not AMX: brgemm runs oneDNN's AMX micro-kernel where the
    CPU has AMX and its AVX512-BF16 one elsewhere."""
    return _cpu_op_reason("causal_attention", ("avx512_bf16",), "bf16 prefill chunks use SDPA", tiles=False)


def causal_attention_op():
    return None if causal_attention_reason() else torch.ops.morphserve.causal_attention


def bf16_amx_reason() -> str | None:
    """None when `torch.ops.morphserve.bf16_amx_linear` (packed bf16 linears streamed through AMX) can run
    here, else why not."""
    return _cpu_op_reason("bf16_amx_linear", ("avx512_bf16", "amx_bf16"), "packed bf16 linears use oneDNN's layout")


def bf16_amx_op():
    return None if bf16_amx_reason() else torch.ops.morphserve.bf16_amx_linear


def bf16_avx512_reason() -> str | None:
    """None when `torch.ops.morphserve.bf16_avx512_linear` (packed bf16 linears with AVX512-BF16, the
    vnni32 layout where there is no AMX) can run here, else why not."""
    return _cpu_op_reason("bf16_avx512_linear", ("avx512_bf16",), "packed bf16 linears use oneDNN's layout",
                          tiles=False)


def bf16_avx512_op():
    return None if bf16_avx512_reason() else torch.ops.morphserve.bf16_avx512_linear


def int8_amx_reason() -> str | None:
    """None when `torch.ops.morphserve.int8_amx_mm` can run here, else why not."""
    return _cpu_op_reason("int8_amx_mm", ("avx512_bf16", "amx_int8"), "INT8 layers use torch's _weight_int8pack_mm")


def int8_amx_op():
    return None if int8_amx_reason() else torch.ops.morphserve.int8_amx_mm


def int8_avx512_reason() -> str | None:
    """None when `torch.ops.morphserve.int8_avx512_mm` (vdpbf16ps on the codes converted to bf16, for CPUs with
    AVX512-BF16 and no AMX-INT8) can run here, else why not."""
    return _cpu_op_reason("int8_avx512_mm", ("avx512_bf16",), "INT8 layers use torch's _weight_int8pack_mm",
                          tiles=False)


def int8_avx512_op():
    return None if int8_avx512_reason() else torch.ops.morphserve.int8_avx512_mm


def int8_avx512_rows_op():
    """The same file's few-rows INT8 op (int8_avx512_rows_mm), where int8_avx512_op runs."""
    return None if int8_avx512_reason() else torch.ops.morphserve.int8_avx512_rows_mm
