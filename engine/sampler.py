"""Next-token sampling: logits processors (engine/logits_processors.py), then greedy or
temperature, min-p, top-k, top-p, with one torch.Generator per request.

Every row is computed from its own logits and its own generator only, so a seeded request draws
the same tokens alone or inside any batch. Sampling uses the exponential race
(argmax(p / E), E ~ Exp(1)), which draws from p with one random number per vocabulary entry.
"""
from __future__ import annotations

from typing import Sequence as Seq

import torch

from engine.kernels import argmax_op
from engine.logits_processors import RowContext, apply_processors, min_p_filter
from engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator | None],
           contexts: Seq[RowContext | None] | None = None) -> list[int]:
    """logits: [N, vocab] (fp32), one row per request -> N token ids. `contexts` (one per row) feed the
    logits processors; without them only temperature / top-k / top-p / min-p apply."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"sample() got logits {tuple(logits.shape)} for {len(params)} requests")
    logits = logits.float()
    if contexts is not None and any(c is not None for c in contexts):
        logits = apply_processors(logits, list(params), list(contexts))
    tokens = greedy(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        scaled = logits.index_select(0, index) / temps.unsqueeze(1)
        min_p = [params[i].min_p for i in rows]
        if any(m > 0 for m in min_p):  # min_p first (vLLM's order): drop what it drops, then top-k/top-p
            kept = min_p_filter(torch.softmax(scaled, dim=-1), min_p)
            scaled = scaled.masked_fill(kept == 0, float("-inf"))
        probs = _filtered_probs(scaled, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            noise[j].exponential_(generator=generators[i])
        tokens[index] = (probs / noise).argmax(dim=-1)
    return tokens.tolist()


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over each row (torch.argmax's ties and NaNs); on CPU through the compiled op, which is
    several times faster than torch's at a batch of vocabulary-wide rows."""
    op = argmax_op() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    return logits.argmax(dim=-1) if op is None else op(logits)


def _filtered_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Softmax over the tokens that survive top-k then top-p (rows: [N, vocab])."""
    if all(k < 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k], device=logits.device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    # p == 1 drops nothing (rounding may push the cumulative sum to 1 early), so an unfiltered row
    # gives bit-identical probabilities on this path and on the shortcut above.
    drop = (mass_before >= p) & (ranks > 0) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)
