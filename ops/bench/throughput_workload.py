"""The offline throughput workloads and their prompts, as token ids, identical for every backend.

    (a) short:  32 requests, 32-token prompts, 64 new tokens each     (decode-bound)
    (b) long:    8 requests, 1,024-token prompts, 64 new tokens each  (prefill-heavy)

Prompts are real ShareGPT first human turns in the model's own tokenizer: request i takes
conversation i's turn, continued with the next conversations' turns when it is shorter than the
target, cut at exactly the target length in tokens. Sending token ids rather than text makes every
backend see the very same prompts, with no tokenizer or chat-template differences. A model folder
without a tokenizer (the tests' tiny random models) gets seeded random ids instead.
"""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

from ops.bench import BenchmarkInputError


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str  # "a" | "b"
    title: str
    num_requests: int
    prompt_tokens: int  # every prompt has exactly this many tokens
    max_tokens: int  # every request generates exactly this many (ignore_eos)

    def __post_init__(self) -> None:
        for field in ("num_requests", "prompt_tokens", "max_tokens"):
            if getattr(self, field) < 1:
                raise BenchmarkInputError(f"scenario {self.name}: {field} must be >= 1")

    @property
    def max_len(self) -> int:
        return self.prompt_tokens + self.max_tokens


FULL = (Scenario("a", "32 req x 32-tok prompt x 64 new", 32, 32, 64),
        Scenario("b", "8 req x 1024-tok prompt x 64 new", 8, 1024, 64))
QUICK = (Scenario("a", "8 req x 32-tok prompt x 16 new", 8, 32, 16),
         Scenario("b", "2 req x 256-tok prompt x 16 new", 2, 256, 16))


@dataclasses.dataclass(frozen=True)
class Workload:
    scenario: Scenario
    prompts: tuple[tuple[int, ...], ...]
    source: str  # "sharegpt" | "random"


def sharegpt_prompts(encode, n: int, length: int, seed: int = 0, path: str | Path | None = None) -> list[list[int]]:
    """n prompts of exactly `length` token ids from ShareGPT first human turns (see the module doc)."""
    from ops.bench.prompts import load_sharegpt_pairs

    pairs = load_sharegpt_pairs(n, seed=seed, path=path)
    turns = [list(encode(p.prompt)) for p in pairs]
    if not any(turns):
        raise BenchmarkInputError("the ShareGPT prompts encode to no tokens at all; check the tokenizer")
    separator = list(encode("\n\n"))
    out = []
    for i in range(n):
        ids = list(turns[i])
        k = 1
        while len(ids) < length:
            ids += separator + turns[(i + k) % n]
            k += 1
        out.append(ids[:length])
    return out


def random_prompts(vocab_size: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]


def build_workloads(hf_dir: Path, scenarios: tuple[Scenario, ...], seed: int = 0) -> list[Workload]:
    """One Workload per scenario; ShareGPT prompts when the folder has a tokenizer, else random ids."""
    from engine.errors import ModelLoadError
    from engine.loader import load_config
    from engine.tokenizer import Tokenizer

    config = load_config(hf_dir)
    longest = max(s.max_len for s in scenarios)
    if longest > config.max_position_embeddings:
        raise BenchmarkInputError(f"the workload needs {longest} positions, the model has "
                                  f"{config.max_position_embeddings}; use --quick or a model with a longer context")
    try:
        tokenizer = Tokenizer.from_dir(hf_dir)
    except ModelLoadError:
        tokenizer = None
    out = []
    for s in scenarios:
        if tokenizer is not None:
            prompts, source = sharegpt_prompts(tokenizer.encode, s.num_requests, s.prompt_tokens, seed), "sharegpt"
        else:
            prompts, source = random_prompts(config.vocab_size, s.num_requests, s.prompt_tokens, seed), "random"
        out.append(Workload(s, tuple(tuple(p) for p in prompts), source))
    return out
