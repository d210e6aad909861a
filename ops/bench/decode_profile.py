"""Per-op CPU profile of one decode step (torch.profiler), batch 1 and 32, for the README's
performance section. Runs against whichever engine is on PYTHONPATH, so a before/after is two runs:

    PYTHONPATH=$PWD .venv/bin/python ops/bench/decode_profile.py --threads 2          # this tree
    PYTHONPATH=/path/to/old/checkout .venv/bin/python ops/bench/decode_profile.py ...   # another engine

Each batch: warm-up steps, then `--steps` profiled steps; the table is self CPU time per step by op.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.batch import ScheduledChunk, SchedulerOutput
from engine.kv_storage import KVStorage
from engine.model_runner import ModelRunner
from engine.loader import load_model
try:
    from engine.precision import resolve_dtype
except ImportError:  # an engine from before dtype=auto: name the dtype
    from engine.precision import parse_dtype as resolve_dtype

BLOCK_SIZE = 16


def make_runner(model, batch: int, context: int, attention: str | None = None, layout: str = "contiguous"):
    """A runner whose storage holds `batch` sequences of `context` tokens, and their decode step
    (the same as ops/bench/decode_step.py, block layouts included; repeated here so an older engine on
    PYTHONPATH can run it)."""
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    c = model.config
    storage = KVStorage(c.num_layers, BLOCK_SIZE, c.num_kv_heads, c.head_dim, model.dtype, "cpu",
                        max_blocks=batch * per_seq, capacity=batch * per_seq)
    # Every page written, as a prefill would: an unwritten page of the storage's anonymous mapping reads as
    # the one shared zero page, always in cache, and attention over it would time cache hits.
    storage.kv.copy_(torch.randn(storage.kv.shape, generator=torch.Generator().manual_seed(0)).to(storage.kv.dtype))

    def table(i: int) -> tuple[int, ...]:
        if layout == "interleaved":  # block j of request i: j * batch + i, as requests that grow together get them
            return tuple(j * batch + i for j in range(per_seq))
        return tuple(range(i * per_seq, (i + 1) * per_seq))

    chunks = tuple(ScheduledChunk(f"r{i}", ((7 * i + 11) % c.vocab_size,), context, table(i), needs_logits=True)
                   for i in range(batch))
    runner = ModelRunner(model, storage, "cpu") if attention is None else ModelRunner(model, storage, "cpu", attention)
    return runner, SchedulerOutput(chunks)


def profile_step(model, batch: int, context: int, steps: int, top: int, attention: str | None = None,
                 layout: str = "contiguous") -> dict:
    runner, step = make_runner(model, batch, context, attention, layout)
    for _ in range(3):
        runner.execute(step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.execute(step)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / steps / 1e3
    ops = [{"op": e.key, "self_ms_per_step": round(e.self_cpu_time_total / steps / 1e3, 3),
            "calls_per_step": e.count // steps} for e in rows[:top]]
    return {"batch": batch, "attention": attention or "default", "total_self_ms_per_step": round(total, 2), "ops": ops}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto", help="auto (the engine's default: bf16 with native bf16, else fp32), bf16, fp32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--block-layout", choices=["contiguous", "interleaved"], default="contiguous",
                    help="the requests' block tables: one run each, or interleaved (ops/bench/decode_step.py)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--attention", nargs="+", default=None, choices=["auto", "in_place", "gather"],
                    help="attention route(s) of this tree's runner, profiled in turn (an older engine: omit)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import engine
    model = load_model(args.model, resolve_dtype(args.dtype), "cpu").model
    report = {"engine": str(Path(engine.__file__).parent), "dtype": str(model.dtype).removeprefix("torch."), "threads": args.threads,
              "context": args.context, "block_layout": args.block_layout, "loadavg_1_5_15": list(os.getloadavg()),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "profiles": [profile_step(model, b, args.context, args.steps, args.top, a, args.block_layout)
                           for b in args.batch for a in (args.attention or [None])]}
    for p in report["profiles"]:
        print(f"\nbatch {p['batch']}, attention {p['attention']}: {p['total_self_ms_per_step']} ms self CPU per step")
        for o in p["ops"]:
            print(f"  {o['self_ms_per_step']:8.2f} ms  x{o['calls_per_step']:<4} {o['op']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
