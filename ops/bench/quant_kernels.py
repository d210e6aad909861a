"""Micro-benchmark: candidate quantized linear kernels vs the engine's packed bf16 linear, per model shape and row count.

    python -m ops.bench.quant_kernels --threads 2 [--rows 1 4 16 32] [--rounds 15] [--copies 30] [--out quant_kernels.json]

Shapes are the default model's (SmolLM2-135M: hidden 576, kv 192, intermediate 1536): o 576x576, fused
q/k/v 576x960, fused gate/up 576x3072, down 1536x576 (in x out). bf16 activations. Every candidate of a
(shape, rows) cell runs once per round, rounds interleaved, so load drift hits all alike; each sample is
the mean call time over `--inner` passes through `--copies` weight copies (30 = the model's layer count, so
the weights stream from memory as in a decode step instead of staying cache-hot). Reported: the minimum and the median over rounds (ms per call)
and each candidate's ratio to `bf16_packed` (the engine's full-precision path, engine/layers/packed.py).

Candidates: `bf16_plain` (F.linear); `bf16_engine` (engine/layers/packed.py's PackedGroup: what the engine
serves full precision with here, the vnni32 layout and the engine's op on a CPU with AVX512-BF16);
`int4_tile` (int4_kernel.int4_tile_op: the engine's INT4 tile op, AMX's or the AVX512-BF16 one, on the
Int4Linear's bytes; where built and the CPU has either); `int4_tinygemm` (the engine's Int4Linear: torch's
`_weight_int4pack_mm_for_cpu`, group size as the engine picks it) and `int4_tinygemm_g32`;
`int8_pack_mm` (Int8Linear on torch's `_weight_int8pack_mm`: the benchmark sets no INT8 threshold);
`int8_tile` (int8.int8_tile_op: the engine's INT8 tile op, AMX-INT8's or the AVX512-BF16 one, on the same
codes) and `int8_rows` (int8.int8_rows_op: the AVX512 CPUs' few-rows INT8 op, below the tile op's threshold);
`int4_dequant_linear` (INT4 dequantized into a reused bf16 scratch by torch ops, then F.linear); `int8_onednn_dynamic` (activations quantized per
tensor to uint8 on the fly, oneDNN `qlinear_pointwise` on a prepacked int8 weight: AMX-INT8, other
numerics); `int4_amx` (the engine's AMX op, engine/kernels/int4_amx.cpp from `make kernels`: int4pack
blocks dequantized to bf16 in cache, AMX brgemm) and `int8_amx` (engine/kernels/int8_amx.cpp: the int8 codes
converted to bf16 in cache, AMX tiles, fp32 scaling); timed where the library is built and the CPU has
AMX-BF16, else left out and the reason printed. `--candidates` times a subset (the baseline always).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.capability import detect_capability
from engine.kernels import int4_amx_op, int4_amx_reason, int8_amx_op, int8_amx_reason
from engine.layers.packed import PackedGroup
from engine.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8
from engine.quant.dispatch import update_amx_dispatch
from engine.quant.int4_kernel import int4_tile_op
from engine.quant.int8 import int8_rows_op, int8_tile_op
from engine.quant.int4_record import unpack_nibbles

SHAPES = [(576, 576), (576, 960), (576, 3072), (1536, 576)]  # (in_features, out_features)
BASELINE = "bf16_packed"


def baseline_reason() -> str | None:
    """Why the baseline cannot run here (None: it can): oneDNN packs bf16 weights only on a CPU with
    native bf16. Elsewhere the engine serves fp32, and `ops.bench.decode_step` compares INT4 with it."""
    from engine.layers.packed import packing_available

    if packing_available(torch.bfloat16, "cpu"):
        return None
    return ("this CPU has no native bf16, so oneDNN cannot pack the bf16 baseline; the engine serves fp32 here: "
            "compare INT4 with it in a decode step (python -m ops.bench.decode_step --threads 2 --batch 1 16)")


def _dynamic_uint8(x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    with warnings.catch_warnings():  # quantized tensor types are deprecated; the oneDNN op itself is not
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_tensor_dynamic(x.float(), torch.quint8, False)
    return q.int_repr(), q.q_scale(), q.q_zero_point()


def candidates(w: torch.Tensor, xs: list[torch.Tensor], amx: bool,
               only: set[str] | None = None) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> a call computing xs[0] @ w.T in that form (weights built once, outside the timing; the caller
    sets xs[0], the activations, before timing); `only`: these and the baseline."""
    calls = _all_candidates(w, xs, amx)
    return {k: f for k, f in calls.items() if only is None or k in only or k == BASELINE}


def _all_candidates(w: torch.Tensor, xs: list[torch.Tensor], amx: bool) -> dict[str, Callable[[], torch.Tensor]]:
    n, k = w.shape
    wb = w.to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, 32)
    i4, i4_32, i8 = Int4Linear(quantize_int4(w, 128)), Int4Linear(quantize_int4(w, 32)), Int8Linear(quantize_int8(w))
    rec = quantize_int4(w, 128)
    g, codes = rec.group_size, unpack_nibbles(rec.qweight).view(n, k // rec.group_size, rec.group_size)
    scales, zeros = rec.scales.to(torch.bfloat16)[..., None], rec.zeros.to(torch.bfloat16)[..., None]
    scratch = torch.empty(n, k // g, g, dtype=torch.bfloat16)

    def dequant_linear() -> torch.Tensor:
        torch.sub(codes, zeros, out=scratch).mul_(scales)
        return F.linear(xs[0], scratch.view(n, k))

    q8 = quantize_int8(w)
    qw = torch.ops.onednn.qlinear_prepack(q8.qweight, None)
    w_zp = torch.zeros(n, dtype=torch.long)

    def onednn_dynamic() -> torch.Tensor:
        qx, s, zp = _dynamic_uint8(xs[0])
        return torch.ops.onednn.qlinear_pointwise(qx, s, zp, qw, q8.scales, w_zp, None, 1.0, 0, torch.bfloat16,
                                                  "none", [], "")

    engine_bf16 = PackedGroup(wb, None)
    calls = {
        BASELINE: lambda: torch.ops.mkldnn._linear_pointwise(xs[0], packed, None, "none", [], ""),
        "bf16_engine": lambda: engine_bf16(xs[0]),
        "bf16_plain": lambda: F.linear(xs[0], wb),
        "int4_tinygemm": lambda: i4(xs[0]),
        "int4_tinygemm_g32": lambda: i4_32(xs[0]),
        "int8_pack_mm": lambda: i8(xs[0]),
        "int4_dequant_linear": dequant_linear,
        "int8_onednn_dynamic": onednn_dynamic,
    }
    if i4.amx:  # the engine's tile op (AMX or AVX512-BF16) reads this weight
        tile = int4_tile_op()
        calls["int4_tile"] = lambda: tile(xs[0], i4.packed, i4.group_size, i4.scales_and_zeros)
    if i8.amx:  # likewise the INT8 tile op, and the few-rows op below its threshold where there is one
        tile8, rows8 = int8_tile_op(), int8_rows_op()
        calls["int8_tile"] = lambda: tile8(xs[0], i8.qweight, i8.scales)
        if rows8 is not None:
            calls["int8_rows"] = lambda: rows8(xs[0], i8.qweight, i8.scales)
    if amx:
        op4, op8 = int4_amx_op(), int8_amx_op()
        calls["int4_amx"] = lambda: op4(xs[0], i4.packed, i4.group_size, i4.scales_and_zeros)
        calls["int8_amx"] = lambda: op8(xs[0], i8.qweight, i8.scales)
    return calls


def max_error(calls: dict[str, Callable[[], torch.Tensor]], w: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """Each candidate's max |y - x @ w.T| relative to max |x @ w.T| (fp32 reference with the unquantized w)."""
    ref = x.float() @ w.t()
    scale = ref.abs().max().item()
    return {name: round((f().float() - ref).abs().max().item() / scale, 5) for name, f in calls.items()}


def time_cell(layers: list[dict[str, Callable[[], torch.Tensor]]], rounds: int, inner: int) -> dict[str, list[float]]:
    """Per candidate, samples of ms per call; one sample = `inner` passes over all layers' copies (with one
    copy the weights stay cache-hot; with as many as the model has layers they stream from memory)."""
    names = list(layers[0])
    for name in names:
        for calls in layers:
            calls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            fs = [calls[name] for calls in layers]
            t0 = time.perf_counter()
            for _ in range(inner):
                for f in fs:
                    f()
            samples[name].append((time.perf_counter() - t0) / (inner * len(fs)) * 1e3)
    return samples


def run(rows: list[int], rounds: int, inner: int, copies: int, amx: bool,
        shapes: list[tuple[int, int]] = SHAPES, only: set[str] | None = None) -> list[dict]:
    if (why := baseline_reason()) is not None:
        raise SystemExit(f"quant_kernels: {why}")
    out = []
    # `int4_tinygemm` / `int8_pack_mm`: Int4Linear / Int8Linear on torch's kernels; the engine's ops are candidates
    update_amx_dispatch(int4_min_rows=None, int8_min_rows=None)
    xs: list[torch.Tensor] = [torch.empty(0)]
    with torch.inference_mode():
        for in_f, out_f in shapes:
            weights = [torch.randn(out_f, in_f) * 0.05 for _ in range(copies)]
            layers = [candidates(w, xs, amx, only) for w in weights]
            for m in rows:
                xs[0] = torch.randn(m, in_f).to(torch.bfloat16)
                samples = time_cell(layers, rounds, inner)
                best = {name: min(v) for name, v in samples.items()}
                med = {name: statistics.median(v) for name, v in samples.items()}
                out.append({"in": in_f, "out": out_f, "rows": m, "min_ms": best, "median_ms": med,
                            "min_ratio_to_bf16": {k: round(v / best[BASELINE], 3) for k, v in best.items()},
                            "median_ratio_to_bf16": {k: round(v / med[BASELINE], 3) for k, v in med.items()},
                            "rel_error": max_error(layers[0], weights[0], xs[0])})
                print(f"{in_f:>5}x{out_f:<5} rows {m:>3}  " + "  ".join(
                    f"{k} {best[k]:.3f}ms x{best[k] / best[BASELINE]:.2f}" for k in best), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32], help="activation rows (batch of a decode step)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--inner", type=int, default=2, help="passes over the copies per sample")
    ap.add_argument("--copies", type=int, default=30, help="weight copies per candidate, cycled (30 = the model's "
                    "layers: weights come from memory as in a decode step; 1 = cache-hot)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--candidates", nargs="+", default=None, help="time only these (and the baseline), e.g. "
                    "int8_pack_mm int8_amx")
    ap.add_argument("--out", type=Path, default=Path("quant_kernels.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if (why := int4_amx_reason() or int8_amx_reason()) is not None:
        print(f"int4_amx and int8_amx left out: {why}")
    only = set(args.candidates) if args.candidates else None
    rows = run(args.rows, args.rounds, args.inner, args.copies, why is None, only=only)
    how = {"torch": torch.__version__, "threads": args.threads, "copies": args.copies, "rounds": args.rounds, "inner": args.inner,
           "capability": str(detect_capability(torch.device("cpu"))), "int4_amx": int4_amx_reason() or "timed",
           "int8_amx": int8_amx_reason() or "timed", "candidates": args.candidates or "all", "machine": platform.processor() or platform.machine(),
           "statistic": "ms per call (min and median over interleaved rounds), bf16 activations; ratio = / bf16_packed"}
    args.out.write_text(json.dumps({"how": how, "cells": rows}, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
