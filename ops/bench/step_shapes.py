"""CPU milliseconds of one model step at the shapes the offline throughput workloads run: decodes at
batch 32 / context 96 (workload a) and batch 8 / context 1,050 (workload b), and prefill chunks of
512 tokens at positions 0 and 512 or 1,024 tokens at once (workload b's prompts under a 512- or a
4,096-token step budget). Runs against whichever engine is on PYTHONPATH, so a before/after is two
runs (alternate them, ABAB, on a shared machine):

    PYTHONPATH=$PWD .venv/bin/python ops/bench/step_shapes.py --out after.json
    PYTHONPATH=/path/to/older/checkout .venv/bin/python ops/bench/step_shapes.py --out before.json

CPU time of this process (1 thread by default), not wall time: on a loaded machine wall time mostly
measures the other jobs. Random token ids; the KV cache holds whatever it holds (the cost does not
depend on the values).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from engine.batch import ScheduledChunk, SchedulerOutput
from engine.kv_storage import KVStorage
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.precision import parse_dtype

BLOCK_SIZE = 16


def decode_step(vocab: int, batch: int, context: int) -> SchedulerOutput:
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    return SchedulerOutput(tuple(ScheduledChunk(f"r{i}", ((7 * i + 11) % vocab,), context,
                                                 tuple(range(i * per_seq, (i + 1) * per_seq)), needs_logits=True)
                                 for i in range(batch)))


def prefill_step(vocab: int, start: int, n: int) -> SchedulerOutput:
    blocks = -(-(start + n) // BLOCK_SIZE)
    return SchedulerOutput((ScheduledChunk("p", tuple((5 * j + 3) % vocab for j in range(n)), start,
                                           tuple(range(blocks)), needs_logits=True),))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per shape (after one warm-up)")
    ap.add_argument("--plain-head", action="store_true", help="an older engine: leave lm_head unpacked (its serving default)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import engine
    model = load_model(args.model, parse_dtype(args.dtype), "cpu").model
    c = model.config
    storage = KVStorage(c.num_layers, BLOCK_SIZE, c.num_kv_heads, c.head_dim, model.dtype, "cpu",
                        max_blocks=1024, capacity=1024)
    runner = ModelRunner(model, storage, "cpu")
    in_place = getattr(model, "head_packed_in_place", False)  # this engine's runner packs it (engine/model.py)
    if in_place and args.plain_head:
        ap.error("this engine packs lm_head in place wherever it packs the layers; --plain-head is for older engines")
    copy = not in_place and not args.plain_head and runner.model.layers[0].pack and hasattr(model, "pack_head")
    if copy:  # an older engine: its copy, as its offline benchmark ran (pack_lm_head)
        model.pack_head()
    packed_head = in_place or copy
    v = c.vocab_size
    shapes = {"decode batch 32, context 96": decode_step(v, 32, 96),
              "decode batch 8, context 1050": decode_step(v, 8, 1050),
              "prefill 512 tokens at 0": prefill_step(v, 0, 512),
              "prefill 512 tokens at 512": prefill_step(v, 512, 512),
              "prefill 1024 tokens at 0": prefill_step(v, 0, 1024)}
    results = {}
    for name, step in shapes.items():
        runner.execute(step)
        started = time.process_time()
        for _ in range(args.repeats):
            runner.execute(step)
        results[name] = round((time.process_time() - started) / args.repeats * 1e3, 1)
        print(f"{name:32s} {results[name]:8.1f} CPU ms per step", flush=True)
    report = {"engine": str(Path(engine.__file__).parent), "dtype": args.dtype, "threads": args.threads,
              "repeats": args.repeats, "packed_head": packed_head, "clock": "process CPU time", "loadavg_1_5_15": list(os.getloadavg()),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_ms_per_step": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
