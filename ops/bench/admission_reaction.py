"""Reaction time of admission-time morphing on one engine (no Ray, no HTTP): a burst of requests at a
budget that holds only a few of them; how long from the first boundary where a request the step
could start did not fit to the boundary where it fitted (the engine's MemoryWait episodes), what was
swapped and restored, and whether anything was preempted.

    .venv/bin/python -m ops.bench.admission_reaction --budget 285MiB --requests 12 --prompt-tokens 200
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.morph.admission import AdmissionGrant
from engine.precision import Precision
from engine.sampling_params import SamplingParams


def run(args: argparse.Namespace) -> dict:
    engine = LLMEngine(EngineConfig(model=args.model, dtype="bf16", memory_budget=args.budget,
                                    max_model_len=args.max_model_len, max_num_batched_tokens=args.batched_tokens,
                                    num_threads=args.threads))
    n = engine.model_config.num_layers
    engine.set_admission_grant(AdmissionGrant(max_quantized=args.max_quantized or n, min_quantized=0,
                                              precision=Precision(args.precision)))
    start = engine.pressure()
    gen = torch.Generator().manual_seed(0)
    t0 = time.monotonic()
    for i in range(args.requests):
        prompt = torch.randint(100, engine.model_config.vocab_size - 1, (args.prompt_tokens,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams.create(max_tokens=args.max_tokens, temperature=0,
                                                                  ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    status = engine.admission.status()
    waits = [w["seconds"] for w in status["waits"]]
    return {"command": vars(args), "start_kv_blocks": start.kv_capacity_blocks,
            "start_quantized": engine.morph_state().forced_quantized, "rung_gain_blocks": dict(start.rung_gain_blocks),
            "steps": steps, "seconds": round(time.monotonic() - t0, 3),
            "preemptions": engine.scheduler.num_preemptions,
            "reaction_s": {"median": statistics.median(waits) if waits else None, "max": max(waits, default=None),
                           "all": waits},
            "events": status["events"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--budget", default="285MiB")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--batched-tokens", type=int, default=256)
    p.add_argument("--precision", default="int4", choices=["int8", "int4"])
    p.add_argument("--max-quantized", type=int, default=None, help="the grant; default: every layer")
    p.add_argument("--threads", type=int, default=2)
    print(json.dumps(run(p.parse_args()), indent=1))


if __name__ == "__main__":
    main()
