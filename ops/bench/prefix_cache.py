"""Prefix caching on a real engine, on and off side by side: a burst of chat requests that share a few
long system prompts (several applications, each with its own instructions), all arriving at once.
For each setting: prompt tokens prefilled, the share found in the cache, TTFT median / P95, and the
burst's wall time. Two engines (cache on, cache off) are built once and alternate run by run
(on, off, on, off, ...), so a drift of this shared machine hits both alike; medians over `--repeats`.

    python -m ops.bench.prefix_cache --dtype auto --threads 1 --repeats 3 --out ops/bench/results/prefix_cache.json

Offline (no server, no morphing): what the cache saves inside one engine. What a fleet's router makes
of it is the fleet benchmark's (`run_all --fleet --system-prompts COUNT TOKENS`).
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

from engine.capability import detect_capability
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from ops.bench.metrics import percentile
from ops.bench.prompts import fit_prompt, load_sharegpt_pairs


def chat_bursts(engine: LLMEngine, num_bursts: int, num_requests: int, num_systems: int, system_tokens: int,
                prompt_tokens: int, seed: int = 0) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Token ids of (one short chat per system prompt, `num_bursts` bursts of `num_requests` chats): request
    i of a burst has system prompt i % num_systems and a user turn of its own, never seen in another burst
    (only the system prompts repeat)."""
    tok = engine.tokenizer
    encode, decode = tok.encode, tok.decode
    users_needed = num_bursts * num_requests
    pairs = load_sharegpt_pairs(users_needed + num_systems + 64, seed=seed)
    fillers = [p.prompt for p in pairs[users_needed + num_systems:]]
    systems = [fit_prompt(pairs[users_needed + k].prompt, system_tokens, encode, decode, fillers)[0]
               for k in range(num_systems)]
    users = [fit_prompt(pairs[i].prompt, prompt_tokens, encode, decode, fillers)[0] for i in range(users_needed)]

    def chat(system: str, user: str) -> list[int]:
        return encode(tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}]))

    chats = [chat(systems[i % num_requests % num_systems], users[i]) for i in range(users_needed)]
    warm = [chat(system, "Hello.") for system in systems]
    return warm, [chats[b * num_requests:(b + 1) * num_requests] for b in range(num_bursts)]


def burst(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int, tag: str) -> dict:
    """Every prompt at once; step until all finish. TTFT from the engine's own arrival and first-token times."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    kv = engine.kv_manager
    queried, hits = kv.prefix_queried_tokens, kv.prefix_hit_tokens
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    ttfts, prefilled = [], 0
    while engine.has_unfinished():
        result = engine.step()
        if result.stats is not None:
            prefilled += result.stats.num_prefill_tokens
        ttfts += [o.first_token_time - o.arrival_time for o in result.outputs if o.finished]
    wall = time.perf_counter() - started
    queried, hits = kv.prefix_queried_tokens - queried, kv.prefix_hit_tokens - hits
    return {"wall_s": wall, "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": percentile(ttfts, 95),
            "prefilled_tokens": prefilled, "hit_share": hits / queried if queried else 0.0}


def warm_cache(engine: LLMEngine, warm: Sequence[list[int]], tag: str) -> None:
    """One short chat per system prompt first: a server that has run a while holds them."""
    burst(engine, warm, 1, tag)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    ap.add_argument("--system-tokens", type=int, default=192)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="each request's own user turn")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = dict(model=args.model, dtype=args.dtype, memory_budget="1GiB", max_model_len=512, enable_morphing=False,
                num_threads=args.threads, max_num_seqs=args.requests)
    engines = {setting: LLMEngine(EngineConfig(**base, enable_prefix_caching=setting == "on")) for setting in ("on", "off")}
    # Each repeat replays a burst of its own (fresh user turns, the same system prompts) on both engines.
    warm, bursts = chat_bursts(engines["on"], args.repeats, args.requests, args.systems, args.system_tokens,
                         args.prompt_tokens)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for r, prompts in enumerate(bursts):
        for setting in ("on", "off") if r % 2 == 0 else ("off", "on"):
            engine = engines[setting]
            warm_cache(engine, warm, f"warm{r}")
            runs[setting].append(burst(engine, prompts, args.max_tokens, f"r{r}"))
            print(setting, r, {k: round(v, 3) for k, v in runs[setting][-1].items()}, flush=True)
    medians = {s: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for s, rs in runs.items()}
    ratios = {k: medians["on"][k] / medians["off"][k] for k in ("wall_s", "ttft_p50_s", "ttft_p95_s", "prefilled_tokens")}
    result = {"command": " ".join([sys.executable, "-m", "ops.bench.prefix_cache", *(argv or sys.argv[1:])]),
              "machine": {"cpu": platform.processor() or platform.machine(),
                          "capability": detect_capability("cpu").as_dict(),
                          "loadavg_1_5_15": list(os.getloadavg()), "threads": args.threads,
                          "dtype": engines["on"].full_precision.value},
              "workload": {"requests": args.requests, "systems": args.systems, "system_tokens": args.system_tokens,
                           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                           "prompt_lengths": [[len(p) for p in prompts] for prompts in bursts]},
              "runs": runs, "medians": medians, "on_over_off": ratios}
    print(json.dumps({"medians": medians, "on_over_off": ratios}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
