"""Morph latency on a real engine: per-layer swap-down / restore time and bytes freed, the per-layer
swap-down of a SetQuantizedTarget (the server's path: the next layer prefetched), KV grow / shrink
time with 0 and with 100 live blocks to migrate, and the process RSS before and after every layer is
swapped down. Medians over `--repeats`. Runs between steps of an idle LLMEngine, through the same
MorphExecutor and KVResizer the server uses (host store built on first start, then reused).

    python -m ops.bench.morph_latency --model default --dtype auto --repeats 5 --out ops/bench/results/morph_latency.json

`--clock cpu` times the calls by this thread's CPU time (time.thread_time; the engine's own swap_seconds
stay wall-clock): on a shared machine a niced run's wall time is mostly waiting for a core, its CPU time
is what the morph costs. Compare runs of two checkouts with the same clock.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.morph.actions import RestoreLayer, SetQuantizedTarget, SwapLayer
from engine.precision import Precision
from engine.quant.int4_kernel import cpu_layout


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def median_ms(values: Sequence[float]) -> float:
    return round(statistics.median(values) * 1e3, 3)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def layer_swaps(engine: LLMEngine, layers: Sequence[int], precision: Precision, repeats: int,
                clock=time.perf_counter) -> list[dict]:
    rows = []
    for layer in layers:
        down, up, down_resize, up_resize, wall_down, wall_up, freed, grown = [], [], [], [], [], [], 0, 0
        for _ in range(repeats):
            t0 = clock()
            r = engine.apply(SwapLayer(layer, precision))
            wall_down.append(clock() - t0)
            t0 = clock()
            back = engine.apply(RestoreLayer(layer))
            wall_up.append(clock() - t0)
            if r.status != "done" or back.status != "done":
                raise RuntimeError(f"layer {layer}: {r.status} {r.message} / {back.status} {back.message}")
            down.append(r.swap_seconds), up.append(back.swap_seconds)
            down_resize.append(r.resize_seconds), up_resize.append(back.resize_seconds)
            freed, grown = -r.weight_bytes_delta, r.kv_blocks_delta
        rows.append({"layer": layer, "precision": precision.value, "bytes_freed": freed, "kv_blocks_grown": grown,
                     "swap_down_ms": median_ms(down), "kv_grow_ms": median_ms(down_resize),
                     "swap_down_total_ms": median_ms(wall_down), "restore_ms": median_ms(up),
                     "kv_shrink_ms": median_ms(up_resize), "restore_total_ms": median_ms(wall_up)})
        print(json.dumps(rows[-1]))
    return rows


def target_swaps(engine: LLMEngine, precision: Precision, layers: int, repeats: int) -> dict:
    """The server's path to a quantized target: SetQuantizedTarget one layer per step boundary, the next
    layer's variant loaded meanwhile on the prefetch worker (waited for here, as a step's time would give
    it). The first swap of a target loads on the engine thread; the later ones only install (swap_seconds)."""
    first, later = [], []
    for _ in range(repeats):
        for i in range(layers):
            engine.morph_executor.swapper.wait_prefetched()
            r = engine.apply(SetQuantizedTarget(layers, precision, max_layers_per_step=1))
            if len(r.layers_changed) != 1:
                raise RuntimeError(f"target step {i}: {r.status} {r.message}")
            (later if i else first).append(r.swap_seconds)
        engine.apply(SetQuantizedTarget(0, precision, max_layers_per_step=layers))
    return {"precision": precision.value, "layers": layers, "first_swap_down_ms": median_ms(first),
            "prefetched_swap_down_ms": median_ms(later)}


def kv_resizes(engine: LLMEngine, blocks: int, live: int, repeats: int, clock=time.perf_counter) -> dict:
    """Shrink by `blocks` with `live` live blocks sitting at the top (all must migrate), then grow back."""
    resizer, kv = engine.kv_resizer, engine.kv_manager
    shrink, grow = [], []
    for _ in range(repeats):
        cap = engine.pool.capacity
        engine.storage.kv[:cap].normal_()  # real contents: untouched pages would make copies free
        if live:
            assert kv.allocate_slots("low", (cap - live) * engine.config.block_size)
            assert kv.allocate_slots("top", live * engine.config.block_size)  # lowest free first -> the top ids
            kv.free("low")
        t0 = clock()
        r = resizer.shrink(blocks)
        spent = clock() - t0
        if r.status != "done" or r.blocks_migrated != live:
            raise RuntimeError(f"shrink: {r}")
        shrink.append(r.seconds if clock is time.perf_counter else spent)
        kv.free("top")
        t0 = clock()
        g = resizer.grow(blocks)
        spent = clock() - t0
        if g.blocks_delta != blocks:
            raise RuntimeError(f"grow: {g}")
        grow.append(g.seconds if clock is time.perf_counter else spent)
        engine.check_integrity()
    return {"blocks": blocks, "live_blocks_migrated": live, "block_bytes": engine.storage.block_bytes,
            "shrink_ms": median_ms(shrink), "grow_ms": median_ms(grow)}


def rss_after_full_morph(engine: LLMEngine, precision: Precision) -> dict:
    n = engine.model_config.num_layers
    before, weights_before = rss_bytes(), engine.ledger.weights
    r = engine.apply(SetQuantizedTarget(n, precision, max_layers_per_step=n))
    after, weights_after = rss_bytes(), engine.ledger.weights
    engine.apply(SetQuantizedTarget(0, precision, max_layers_per_step=n))
    return {"precision": precision.value, "status": r.status, "ledger_weights_freed": weights_before - weights_after,
            "rss_before": before, "rss_after": after, "rss_freed": before - after,
            "rss_after_restore": rss_bytes(), "kv_blocks_grown": r.kv_blocks_delta}


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--memory-budget", default="1GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", default="all", help="'all' or comma-separated layer ids")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: the engine's swap/resize seconds; cpu: this thread's CPU time per call (shared machines)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    config = EngineConfig(model=args.model, dtype=args.dtype, memory_budget=args.memory_budget,
                          max_model_len=2048, num_threads=args.threads)
    clock = CLOCKS[args.clock]
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    start_s = time.perf_counter() - t0
    n = engine.model_config.num_layers
    layers = list(range(n)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    report = {
        "how": {"command": "python -m ops.bench.morph_latency " + " ".join(sys.argv[1:] if argv is None else argv), "model": engine.model_name,
                "dtype": args.dtype, "budget": config.memory_budget_bytes, "repeats": args.repeats,
                "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(), "engine_start_s": round(start_s, 2),
                "host_store": str(engine.morph_executor.swapper.store.path),
                "host_store_build_s": engine.morph_executor.swapper.store.manifest.build_seconds,
                "int4_cpu_layout": cpu_layout(), "capability": engine.runner.capability.as_dict(),
                "resolved_dtype": str(config.torch_dtype).removeprefix("torch."), "clock": args.clock},  # INT4 swap-downs copy stored bytes in this layout
        "kv_capacity_blocks": engine.pool.capacity,
        "swap_int4": layer_swaps(engine, layers, Precision.INT4, args.repeats, clock),
        "swap_int8": layer_swaps(engine, layers[:3], Precision.INT8, args.repeats, clock),
        "target_int4": target_swaps(engine, Precision.INT4, min(8, n), args.repeats),
        "kv_resize": [kv_resizes(engine, 100, 0, args.repeats, clock), kv_resizes(engine, 100, 100, args.repeats, clock)],
        "rss": rss_after_full_morph(engine, Precision.INT4),
    }
    s = report["swap_int4"]
    report["summary"] = {k: median_ms([r[k] / 1e3 for r in s]) for k in
                         ("swap_down_ms", "swap_down_total_ms", "restore_ms", "restore_total_ms", "kv_grow_ms", "kv_shrink_ms")}
    report["summary"]["bytes_freed_per_layer"] = statistics.median(r["bytes_freed"] for r in s)
    report["summary"]["target_prefetched_swap_down_ms"] = report["target_int4"]["prefetched_swap_down_ms"]
    print(json.dumps({k: report[k] for k in ("summary", "target_int4", "kv_resize", "rss")}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
