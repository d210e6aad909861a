"""Hugging Face `generate` as an offline-throughput backend (a worker of ops/bench/throughput.py).

    python -m ops.bench.hf_offline --model-dir HF_DIR --threads 2 --max-model-len 2048 --kv-gib 1

All requests of a run go in one batch, left-padded (the usual way to batch a decoder-only model), in
bf16, greedy. EOS is ignored by removing it from the generation config, so every row makes exactly
max_tokens tokens and the argmax is never bent (min_new_tokens would mask EOS logits instead).
--max-model-len, --kv-gib and --max-num-batched-tokens do not apply: HF grows its cache as it goes.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch

from ops.bench.offline_worker import serve, worker_args


class HfBackend:
    def __init__(self, model_dir: str, threads: int):
        import transformers

        torch.set_num_threads(threads)
        self._model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        config = self._model.config
        pad = getattr(config, "pad_token_id", None)
        self._pad_id = int(pad if pad is not None else 0)  # padded positions are masked: any id works
        self._info = {"backend": "hf", "transformers": transformers.__version__, "torch": torch.__version__,
                      "dtype": "bfloat16", "threads": threads, "attn_implementation": config._attn_implementation,
                      "batching": "one left-padded batch per run"}

    def info(self) -> dict:
        return self._info

    def _generation_config(self, max_tokens: int):
        gc = copy.deepcopy(self._model.generation_config)
        gc.update(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=None, eos_token_id=None,
                  pad_token_id=self._pad_id, temperature=None, top_p=None, top_k=None)
        return gc

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[int]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = self._model.generate(input_ids=ids, attention_mask=mask,
                                       generation_config=self._generation_config(max_tokens))
        return [int(out.shape[1] - width)] * len(prompts)


def main() -> None:
    args = worker_args(__doc__.splitlines()[0])
    serve(lambda: HfBackend(args.model_dir, args.threads))


if __name__ == "__main__":
    main()
