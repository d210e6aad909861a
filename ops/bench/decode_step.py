"""Decode step time with 0, 15 and 30 layers quantized (INT4 and/or INT8; full-precision model, dtype=auto by default), batch 1 and 16, side by side.

One decode step = every sequence of the batch decodes one token at position `--context` through the
real ModelRunner and paged KV storage (the KV holds zeros: attention costs the same whatever it
holds). Layers are switched to the `--rung` (int4, int8, or both, interleaved) in the LIS swap order (the
committed profile; front-to-back without one), RTN (INT4: the same packed kernel as AWQ, so the same speed). On a shared machine the
configurations are interleaved round by round, so load drift hits them alike; each round times
`--steps` consecutive steps, and the reported figure is the median over rounds of the mean step time.
`--int4-amx-min-rows never auto 8` interleaves INT4 kernel dispatch settings (EngineConfig.int4_amx_min_rows:
torch's int4pack kernel only, the engine's default, the tile op from 8 rows up) in the same rounds; `--int4-avx2 on off` likewise
the engine's fp32 AVX2 INT4 op vs torch's kernel in bf16 (CPUs without AVX-512); `--int8-amx-min-rows` sets
the INT8 threshold (EngineConfig.int8_amx_min_rows: a number, 'auto' (the default), or 'never' = torch's
_weight_int8pack_mm only).

    python -m ops.bench.decode_step --model default --out decode_step.json
    python -m ops.bench.decode_step --rung int8 int4 --threads 1 --clock cpu   # both rungs, one run
    python -m ops.bench.decode_step --prefill 128 512 --layers 0 18   # one prefill chunk of 128 / 512 tokens instead

`--prefill N ...` times one request's first prefill chunk of N tokens (what a morphed replica runs when
a burst's prompts arrive) in place of the decode batches.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.batch import ScheduledChunk, SchedulerOutput
from engine.kv_storage import KVStorage
from engine.model import Transformer
from engine.model_runner import ModelRunner
from engine.loader import load_model
from engine.morph.profiler import LayerSwitch
from engine.quant.awq import LayerWeights
from engine.quant.int4_kernel import resolve_int4_min_rows
from engine.quant.int8 import resolve_int8_min_rows
from engine.capability import detect_capability
from engine.config import EngineConfig
from engine.kernels import int4_amx_reason, int4_avx2_reason, int8_amx_reason
from engine.quant.dispatch import update_amx_dispatch
from engine.precision import Precision, resolve_dtype
from engine.quant.awq import quantize_layer_rtn
from engine.quant.int4_kernel import cpu_layout

BLOCK_SIZE = 16


BLOCK_LAYOUTS = ("contiguous", "interleaved")


def decode_batch(batch: int, context: int, vocab: int, layout: str = "contiguous") -> SchedulerOutput:
    """`batch` one-token chunks at position `context`, each request with its own blocks: `contiguous`
    (request i holds one run of blocks) or `interleaved` (block j of request i is j * batch + i, what the
    block pool hands out to requests that grow together, so every block read jumps in memory)."""
    per_seq = -(-(context + 1) // BLOCK_SIZE)

    def table(i: int) -> tuple[int, ...]:
        if layout == "interleaved":
            return tuple(j * batch + i for j in range(per_seq))
        return tuple(range(i * per_seq, (i + 1) * per_seq))

    chunks = tuple(ScheduledChunk(f"r{i}", ((7 * i + 11) % vocab,), context, table(i), needs_logits=True)
                   for i in range(batch))
    return SchedulerOutput(chunks)


def prefill_chunk(tokens: int, vocab: int) -> SchedulerOutput:
    """One request's first prefill chunk of `tokens` tokens."""
    return SchedulerOutput((ScheduledChunk("p", tuple((5 * j + 3) % vocab for j in range(tokens)), 0,
                                           tuple(range(-(-tokens // BLOCK_SIZE))), needs_logits=True),))


def make_runner(model: Transformer, batch: int, context: int, attention: str = "auto") -> ModelRunner:
    c, device = model.config, model.device
    blocks = batch * -(-(context + 1) // BLOCK_SIZE)
    storage = KVStorage(c.num_layers, BLOCK_SIZE, c.num_kv_heads, c.head_dim, model.dtype, device,
                        max_blocks=blocks, capacity=blocks)
    fill_cache(storage)
    return ModelRunner(model, storage, device, attention)


def fill_cache(storage: KVStorage) -> None:
    """Write every cache page, as the prompts' prefill would. An unwritten page of the CPU storage (an
    anonymous mapping) reads as the kernel's one shared zero page, always in cache: attention over it
    would time cache hits, not the DRAM reads a real step makes."""
    g = torch.Generator(device=storage.kv.device).manual_seed(0)
    storage.kv.copy_(torch.randn(storage.kv.shape, generator=g, device=storage.kv.device).to(storage.kv.dtype))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU seconds (a loaded
# machine inflates wall time with waiting; CPU time of a 1-thread run tracks the work; CPU devices only)


def time_steps(runner: ModelRunner, step: SchedulerOutput, steps: int, clock=time.perf_counter) -> float:
    """Mean seconds per decode step over `steps` consecutive steps."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    start = clock()
    for _ in range(steps):
        runner.execute(step)
    sync()  # CUDA launches are asynchronous: time the work, not the launches
    return (clock() - start) / steps


def configurations(rungs: Sequence[str], counts: Sequence[int]) -> list[tuple[str, int]]:
    """(rung, quantized layers) to time: 0 layers (full precision) once, under the first rung's name."""
    return [(r, n) for i, r in enumerate(rungs) for n in counts if n or i == 0]


def bench(model: Transformer, switches: dict[str, LayerSwitch], order: Sequence[int], counts: Sequence[int],
          batches: Sequence[int], context: int, rounds: int, steps: int,
          clock=time.perf_counter, attention: Sequence[str] = ("auto",),
          dispatches: Sequence[tuple[str, dict]] = (("", {}),), prefill: bool = False,
          block_layout: str = "contiguous") -> dict[str, dict[str, float]]:
    """{"batch=<b>": {"<rung>=<n>": median seconds per step}} over interleaved rounds (one warm-up round);
    `switches`: rung -> its LayerSwitch ("int4=0" or "int8=0" is full precision); with several attention
    routes the keys are "<rung>=<n> attention=<route>"; `dispatches` are (key suffix, update_amx_dispatch
    changes) to interleave (INT4 kernel settings, e.g. (" amx=never", {"int4_min_rows": None})). `prefill`: each of `batches` is a prefill chunk's token
    count ("prefill=<n>") instead of a decode batch; `block_layout`: the decode requests' block tables
    (decode_batch)."""
    vocab = model.config.vocab_size
    runners = {(b, a): ((make_runner(model, 1, b, a), prefill_chunk(b, vocab)) if prefill else
                        (make_runner(model, b, context, a), decode_batch(b, context, vocab, block_layout)))
               for b in batches for a in attention}
    configs = configurations(list(switches), counts)
    samples: dict[tuple, list[float]] = {(b, a, c, d): [] for b, a in runners for c in configs for d, _ in dispatches}
    for r in range(rounds + 1):
        for rung, n in configs:
            for i in order[:n]:
                switches[rung].quantize(i)
            try:
                for d, changes in dispatches:
                    update_amx_dispatch(**changes)
                    for (b, a), (runner, step) in runners.items():
                        t = time_steps(runner, step, steps, clock)
                        if r > 0:  # round 0 warms caches and the kernels' packing paths
                            samples[(b, a, (rung, n), d)].append(t)
            finally:
                for i in order[:n]:
                    switches[rung].restore(i)
    suffix = (lambda a: f" attention={a}") if len(attention) > 1 else (lambda a: "")
    kind = "prefill" if prefill else "batch"
    return {f"{kind}={b}": {f"{c[0]}={c[1]}{suffix(a)}{d}": statistics.median(samples[(b, a, c, d)])
                           for a in attention for c in configs for d, _ in dispatches} for b in batches}


def dispatch_settings(amx_rows: Sequence[str], avx2: Sequence[str]) -> list[tuple[str, dict]]:
    """(key suffix, update_amx_dispatch changes) for every combination; a setting with one value adds no suffix."""
    out = []
    for m in amx_rows:
        for v in avx2:
            rows = None if m in ("never", "None") else resolve_int4_min_rows("auto" if m == "auto" else int(m))
            label = (f" amx={m}" if len(amx_rows) > 1 else "") + (f" avx2={v}" if len(avx2) > 1 else "")
            out.append((label, {"int4_min_rows": rows, "int4_avx2": v == "on"}))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from engine.morph.swap_order import resolve_swap_order

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, default=Path("decode_step.json"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 15, 30])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=128, help="tokens already in each sequence's KV")
    ap.add_argument("--block-layout", choices=BLOCK_LAYOUTS, default="contiguous",
                    help="decode requests' block tables: one run each, or interleaved as requests that grow together get them")
    ap.add_argument("--prefill", type=int, nargs="+", default=None,
                    help="time one prefill chunk of each of these token counts instead of the decode batches")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="consecutive steps timed per round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "in_place", "gather"],
                    help="attention route(s); several are interleaved, e.g. --attention in_place gather")
    ap.add_argument("--int4-amx-min-rows", nargs="+", default=[str(EngineConfig.model_fields["int4_amx_min_rows"].default)],
                    help="INT4 dispatch threshold(s) (EngineConfig.int4_amx_min_rows; 'never' = torch's kernel only); "
                         "several are interleaved, e.g. never 8")
    ap.add_argument("--int4-avx2", nargs="+", default=["on"], choices=["on", "off"],
                    help="the engine's fp32 AVX2 INT4 op (where torch packs the AVX2 layout) or torch's kernel in bf16; "
                         "both are interleaved with: --int4-avx2 on off")
    ap.add_argument("--rung", nargs="+", default=["int4"], choices=["int4", "int8"],
                    help="quantized rung(s) the layers switch to; several are interleaved, e.g. --rung int8 int4")
    ap.add_argument("--int8-amx-min-rows", default=str(EngineConfig.model_fields["int8_amx_min_rows"].default),
                    help="INT8 dispatch threshold (EngineConfig.int8_amx_min_rows: a number, 'auto' or 'never' = torch's kernel only)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall, or cpu (process CPU time: steadier on a loaded machine, with --threads 1)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dispatches = dispatch_settings(args.int4_amx_min_rows, args.int4_avx2)
    m8 = args.int8_amx_min_rows
    update_amx_dispatch(int8_min_rows=None if m8 in ("never", "None") else resolve_int8_min_rows("auto" if m8 == "auto" else int(m8)))
    loaded = load_model(args.model, resolve_dtype(args.dtype, args.device), args.device)
    name, model = loaded.files.name, loaded.model
    num_layers = model.config.num_layers
    if max(args.layers) > num_layers:
        raise SystemExit(f"--layers {args.layers}: the model has only {num_layers} layers")
    order = resolve_swap_order(num_layers, name)
    switches = {rung: LayerSwitch(model, {i: quantize_layer_rtn(LayerWeights.of_layer(model.layers[i]), Precision(rung))
                                          for i in order.order[:max(args.layers)]}) for rung in args.rung}
    results = bench(model, switches, order.order, args.layers, args.prefill or args.batch, args.context,
                    args.rounds, args.steps, CLOCKS[args.clock], args.attention, dispatches, prefill=bool(args.prefill),
                    block_layout=args.block_layout)
    report = {"model": name, "dtype": str(model.dtype).removeprefix("torch."), "device": args.device,
              "capability": detect_capability(args.device).as_dict(), "loadavg_1_5_15": list(os.getloadavg()), "threads": torch.get_num_threads(),
              "context": args.context, "block_layout": args.block_layout, "prefill_tokens": args.prefill, "clock": args.clock, "rounds": args.rounds, "steps_per_round": args.steps,
              "swap_order": order.source, "attention": args.attention, "rungs": args.rung,
              "int4": "rtn, group 128 (64 where needed)", "int8": "rtn, per output channel",
              "int4_amx_min_rows": args.int4_amx_min_rows, "int4_amx": int4_amx_reason() or "available",
              "int4_avx2": args.int4_avx2, "int4_avx2_op": int4_avx2_reason() or "available", "int4_layout": cpu_layout(),
              "int8_amx_min_rows": args.int8_amx_min_rows, "int8_amx": int8_amx_reason() or "available",
              "median_seconds_per_step": results}
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    columns = list(next(iter(results.values())))
    print(f"{'':<10}" + "".join(f"{c:>{max(14, len(c) + 2)}}" for c in columns))
    for key, row in results.items():
        print(f"{key:<10}" + "".join(f"{row[c] * 1e3:>{max(14, len(c) + 2) - 3}.2f} ms" for c in columns))
    if len(dispatches) > 1:
        for key, row in results.items():
            base = row[f"{args.rung[0]}={args.layers[0]}{dispatches[0][0]}"]  # <rung>=0: full precision
            print(key, "ratio to", f"{args.rung[0]}={args.layers[0]}{dispatches[0][0]}:",
                  " ".join(f"{r}={n}{d}: {row[f'{r}={n}{d}'] / base:.3f}"
                           for r, n in configurations(args.rung, args.layers) for d, _ in dispatches))
    elif len(args.attention) == 1 and 0 in args.layers:
        for key, row in results.items():
            base = row[f"{args.rung[0]}=0"]  # full precision
            print(key, "ratio to full precision:", " ".join(f"{r}={n}: {row[f'{r}={n}'] / base:.3f}"
                                                             for r, n in configurations(args.rung, args.layers) if n))
    if len(args.attention) > 1:
        for key, row in results.items():
            for r, n in configurations(args.rung, args.layers):
                base = row[f"{r}={n} attention={args.attention[-1]}"]
                print(key, f"{r}={n}", " ".join(f"{a}/{args.attention[-1]} = {row[f'{r}={n} attention={a}'] / base:.3f}"
                                                for a in args.attention[:-1]))
    print(f"{name} {args.dtype} on {torch.get_num_threads()} CPU threads, context {args.context}; "
          f"order {order.source} -> {args.out}")


if __name__ == "__main__":
    main()
