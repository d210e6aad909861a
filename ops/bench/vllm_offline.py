"""vLLM's CPU build as an offline-throughput backend (a worker of ops/bench/throughput.py).

Runs in vLLM's own venv (ops/bench/setup_vllm.sh), never in ours:

    .venv-vllm/bin/python -m ops.bench.vllm_offline --model-dir HF_DIR --threads 2 --max-model-len 2048 --kv-gib 1

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so this process's peak RSS is
vLLM's whole footprint. Its threads are not pinned (VLLM_CPU_OMP_THREADS_BIND=nobind; set the variable
to e.g. 0-1 to pin them): our engine and HF are not pinned either, and on a shared, busy machine a
pinned thread waits for its one core while a floating one takes whichever is free (in a first run
here, pinned to core 0 under load, vLLM made 14.5 generated tok/s on workload (a) where ours and HF
made 120-177). vLLM's automatic binding would also keep one of two cores for a scheduler process that
does not exist in this mode.
"""
from __future__ import annotations

import os
from typing import Sequence

from ops.bench.offline_worker import serve, worker_args


class VllmBackend:
    def __init__(self, model_dir: str, threads: int, max_model_len: int, kv_gib: float,
                 max_num_batched_tokens: int | None):
        # vLLM reads these when it is imported / the engine starts, so they are set first.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_gib)))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # else vLLM drops its torch threads to 1
        import vllm

        kwargs = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
        self._vllm = vllm
        # Prefix caching off: every repeat sends the same prompts, so vLLM (alone of the three) would
        # skip their prefill from the second run on and measure a cache instead of an engine.
        self._llm = vllm.LLM(model=model_dir, dtype="bfloat16", max_model_len=max_model_len, seed=0,
                             enable_prefix_caching=False, **kwargs)
        sched = self._llm.llm_engine.vllm_config.scheduler_config
        self._info = {"backend": "vllm", "vllm": vllm.__version__, "dtype": "bfloat16",
                      "kv_cache_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]), "prefix_caching": False,
                      "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "threads": threads,
                      "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens}

    def info(self) -> dict:
        return self._info

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[int]:
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self._llm.generate(inputs, params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    args = worker_args(__doc__.splitlines()[0])
    serve(lambda: VllmBackend(args.model_dir, args.threads, args.max_model_len, args.kv_gib,
                              args.max_num_batched_tokens))


if __name__ == "__main__":  # vLLM's CPU engine may spawn processes: the guard keeps them from re-running main
    main()
