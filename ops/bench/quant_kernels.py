"""Micro-benchmark: bf16 F.linear vs Int8Linear vs Int4Linear, batch 1 and 16.

    python -m ops.bench.quant_kernels [--repeats 50] [--threads 1] [--device cpu] [--out quant_kernels.json]

Prints a table of median milliseconds per call (bf16 activations) and saves it, with how it was run, as JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8

SHAPES = [(576, 1536), (1536, 576), (2048, 2048)]  # (in_features, out_features)
BATCHES = [1, 16]


def median_ms(fn, repeats: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(repeats: int, device: torch.device) -> list[dict]:
    rows = []
    for in_f, out_f in SHAPES:
        w = (torch.randn(out_f, in_f) * 0.05).to(device)
        dense = w.to(torch.bfloat16)
        i8, i4 = Int8Linear(quantize_int8(w)), Int4Linear(quantize_int4(w, 128))
        for batch in BATCHES:
            x = torch.randn(batch, in_f, device=device, dtype=torch.bfloat16)
            with torch.inference_mode():
                rows.append({"in": in_f, "out": out_f, "batch": batch,
                             "bf16_ms": median_ms(lambda: F.linear(x, dense), repeats, device),
                             "int8_ms": median_ms(lambda: i8(x), repeats, device),
                             "int4_ms": median_ms(lambda: i4(x), repeats, device),
                             "int4_backend": i4.backend, "int4_group": i4.group_size})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=Path("quant_kernels.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = run(args.repeats, torch.device(args.device))
    print(f"{'in x out':>11} {'batch':>5} {'bf16 ms':>8} {'int8 ms':>8} {'int4 ms':>8}  int4 backend/group")
    for r in rows:
        print(f"{r['in']:>5}x{r['out']:<5} {r['batch']:>5} {r['bf16_ms']:>8.3f} {r['int8_ms']:>8.3f} "
              f"{r['int4_ms']:>8.3f}  {r['int4_backend']}/{r['int4_group']}")
    how = {"torch": torch.__version__, "device": args.device, "threads": args.threads, "repeats": args.repeats,
           "machine": platform.processor() or platform.machine(), "statistic": "median ms per call, bf16 input"}
    args.out.write_text(json.dumps({"how": how, "rows": rows}, indent=2))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
