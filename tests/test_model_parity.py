"""Logits parity of engine.model + engine.model_runner with Hugging Face transformers (fp32):
whole-prompt prefill, token-by-token decode, and chunked prefill, over paged KV in scattered blocks."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_hf_model
from engine.batch import ScheduledChunk, SchedulerOutput
from engine.kv_storage import KVStorage
from engine.loader import load_config, load_weights
from engine.model import Transformer, build_model
from engine.model_runner import ModelRunner

TOL = 1e-3
BLOCK_SIZE = 4


def load_model(hf_dir: Path) -> Transformer:
    return build_model(load_config(hf_dir), load_weights(hf_dir, torch.float32), torch.float32, "cpu")


def hf_model(hf_dir: Path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


class Session:
    """One request's view of a runner: scattered block ids, chunks built by hand."""

    def __init__(self, model: Transformer, max_blocks: int = 64, seed: int = 0):
        c = model.config
        self.storage = KVStorage(c.num_layers, BLOCK_SIZE, c.num_kv_heads, c.head_dim, torch.float32, "cpu",
                                 max_blocks=max_blocks, capacity=max_blocks)
        self.runner = ModelRunner(model, self.storage, "cpu")
        self.free = list(range(max_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous tables exercise the gather

    def table(self, num_tokens: int) -> tuple[int, ...]:
        n = -(-num_tokens // BLOCK_SIZE)
        return tuple(self.free[:n])

    def run(self, tokens: list[int], start: int, table: tuple[int, ...], rid: str = "r") -> torch.Tensor:
        chunk = ScheduledChunk(rid, tuple(tokens), start, table, needs_logits=True)
        return self.runner.execute(SchedulerOutput((chunk,)))[0]


@torch.inference_mode()
def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [L, V]


def check_parity(model: Transformer, hf, tokens: list[int]) -> None:
    ref = reference_logits(hf, tokens)
    n = len(tokens)

    s = Session(model)  # whole prompt in one chunk
    assert (s.run(tokens, 0, s.table(n)) - ref[-1]).abs().max() < TOL

    s = Session(model, seed=1)  # a short prefill, then one token at a time
    table = s.table(n)
    got = [s.run(tokens[:3], 0, table)] + [s.run([tokens[p]], p, table) for p in range(3, n)]
    assert (torch.stack(got) - ref[2:]).abs().max() < TOL

    s = Session(model, seed=2)  # chunked prefill in 3 chunks, the later ones at start_pos > 0
    table, cuts = s.table(n), [0, n // 3, 2 * n // 3 + 1, n]
    got = [s.run(tokens[a:b], a, table) for a, b in zip(cuts, cuts[1:])]
    assert (torch.stack(got) - ref[[b - 1 for b in cuts[1:]]]).abs().max() < TOL


TINY_VARIANTS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
}


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_model_matches_transformers(tmp_path, variant):
    arch, overrides = TINY_VARIANTS[variant]
    hf_dir = make_tiny_hf_model(tmp_path / variant, arch=arch, **overrides)
    tokens = torch.randint(3, 256, (19,), generator=torch.Generator().manual_seed(7)).tolist()
    check_parity(load_model(hf_dir), hf_model(hf_dir), tokens)


def test_rope_scaling_reaches_the_model(tmp_path):
    _, overrides = TINY_VARIANTS["llama3-rope"]
    model = load_model(make_tiny_hf_model(tmp_path / "m", **overrides))
    assert model.config.rope_scaling["rope_type"] == "llama3"


# --- the real default model (SmolLM2-135M-Instruct) -------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "import numpy as np\n",
           "My favourite book is", "In 1969, the first humans"]


@pytest.fixture(scope="module")
def default_models(request):
    hf_dir = request.getfixturevalue("default_model_dir")
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    return hf_dir, load_model(hf_dir), hf_model(hf_dir), tokenizer


@pytest.mark.slow
def test_default_model_logits_match(default_models):
    _, model, hf, tokenizer = default_models
    for prompt in PROMPTS[:2]:
        check_parity(model, hf, tokenizer(prompt)["input_ids"])


def greedy(model: Transformer, tokens: list[int], steps: int, banned: list[int]) -> list[int]:
    s, out = Session(model, max_blocks=16), []
    table = s.table(len(tokens) + steps)
    logits = s.run(tokens, 0, table)
    for i in range(steps):
        # What min_new_tokens does to EOS in generate(); out of place: logits are inference tensors.
        logits = logits.index_fill(0, torch.tensor(banned, dtype=torch.long), float("-inf"))
        out.append(int(logits.argmax()))
        if i + 1 < steps:
            logits = s.run([out[-1]], len(tokens) + i, table)
    return out


@pytest.mark.slow
def test_default_model_greedy_matches_generate(default_models):
    _, model, hf, tokenizer = default_models
    eos = hf.generation_config.eos_token_id
    banned = [eos] if isinstance(eos, int) else list(eos or [])
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        assert greedy(model, ids, 16, banned) == ref, prompt
