"""Decode step time with lm_head packed in place (the engine's default where the vnni32 layout runs:
engine/model.py, Transformer.pack_linears) against the same model with a plain head (F.linear on the
vocab x hidden table, what every earlier engine ran by default), side by side in one process.

    python -m ops.bench.lm_head --threads 2 --batch 1 32 --out lm_head.json

Both heads hold the same bytes (the plain one is read back from the packed one, bit-identical) and every
other part of the step is shared, so the ratio is the head's share alone. Rounds alternate the two, each
round times `--steps` consecutive decode steps per batch (real ModelRunner, paged KV written with random
values, `--block-layout` tables) and, inside them, each compute_logits call (the final norm, the head and
the fp32 cast: the head's own time, which a noisy machine blurs less than the whole step's); the figures
are medians over rounds and the median of the per-round ratios.
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

from engine.capability import detect_capability
from engine.layers.linear import DenseLinear
from engine.loader import load_model
from engine.model import Transformer
from engine.precision import resolve_dtype
from ops.bench.decode_step import BLOCK_LAYOUTS, decode_batch, make_runner, time_steps

HEADS = ("packed", "plain")


class LogitsClock:
    """Seconds spent in model.compute_logits (final norm, head, fp32 cast) inside the steps, wrapped on the
    instance while in use: the head's own share, which the whole step's time dilutes with noise."""

    def __init__(self, model: Transformer):
        self.model, self.calls = model, []
        self._inner = model.compute_logits

    def __enter__(self) -> "LogitsClock":
        def timed(hidden):
            start = time.perf_counter()
            out = self._inner(hidden)
            self.calls.append(time.perf_counter() - start)
            return out
        self.model.compute_logits = timed
        return self

    def __exit__(self, *exc) -> None:
        del self.model.compute_logits  # the class's method again

    def take(self) -> float:
        """Median seconds per call since the last take."""
        out, self.calls = statistics.median(self.calls), []
        return out


def bench(model: Transformer, batches: Sequence[int], context: int, rounds: int, steps: int,
          layout: str) -> dict[str, dict]:
    runners = {b: (make_runner(model, b, context), decode_batch(b, context, model.config.vocab_size, layout))
               for b in batches}  # the first one packs the linears, and the head with them
    if not model.head_packed_in_place:
        raise SystemExit("lm_head is not packed in place here (it needs bf16 with native bf16 and the engine's "
                         "kernels built: python -m engine.kernels.build); nothing to compare")
    heads = {"packed": model.lm_head, "plain": DenseLinear(model.lm_head.weight, model.lm_head.bias)}
    steps_s = {(b, h): [] for b in batches for h in HEADS}
    logits_s = {(b, h): [] for b in batches for h in HEADS}
    try:
        with LogitsClock(model) as clock:
            for r in range(rounds + 1):
                for h in HEADS:
                    model.set_head(heads[h])
                    for b, (runner, step) in runners.items():
                        t = time_steps(runner, step, steps)
                        head = clock.take()
                        if r > 0:  # round 0 warms caches
                            steps_s[(b, h)].append(t)
                            logits_s[(b, h)].append(head)
    finally:
        model.set_head(heads["packed"])
    out = {}
    for b in batches:
        ratios = [p / q for p, q in zip(steps_s[(b, "packed")], steps_s[(b, "plain")])]
        head_ratios = [p / q for p, q in zip(logits_s[(b, "packed")], logits_s[(b, "plain")])]
        out[f"batch={b}"] = {**{f"{h}_ms": 1e3 * statistics.median(steps_s[(b, h)]) for h in HEADS},
                             **{f"{h}_logits_ms": 1e3 * statistics.median(logits_s[(b, h)]) for h in HEADS},
                             "round_ratios": [round(x, 4) for x in ratios],
                             "median_ratio_packed_to_plain": statistics.median(ratios),
                             "logits_median_ratio_packed_to_plain": statistics.median(head_ratios)}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, default=Path("lm_head.json"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=128, help="tokens already in each sequence's KV")
    ap.add_argument("--block-layout", choices=BLOCK_LAYOUTS, default="interleaved")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3, help="consecutive steps timed per round")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, resolve_dtype("auto", "cpu"), "cpu")
    model = loaded.model
    results = bench(model, args.batch, args.context, args.rounds, args.steps, args.block_layout)
    report = {"model": loaded.files.name, "dtype": str(model.dtype).removeprefix("torch."),
              "capability": detect_capability("cpu").as_dict(), "loadavg_1_5_15": list(os.getloadavg()),
              "threads": torch.get_num_threads(), "context": args.context, "block_layout": args.block_layout,
              "rounds": args.rounds, "steps_per_round": args.steps, "results": results}
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    for key, row in results.items():
        print(f"{key}: step packed {row['packed_ms']:.2f} ms, plain {row['plain_ms']:.2f} ms, median ratio "
              f"{row['median_ratio_packed_to_plain']:.3f}; logits (norm + head) packed {row['packed_logits_ms']:.2f} ms, "
              f"plain {row['plain_logits_ms']:.2f} ms, median ratio {row['logits_median_ratio_packed_to_plain']:.3f}")


if __name__ == "__main__":
    main()
