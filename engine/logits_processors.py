"""What a request's sampling settings do to its logits before a token is drawn (vLLM's order):

    logit_bias -> min_tokens (eos and stop ids masked) -> penalties -> grammar mask
    then, in the sampler: temperature -> min_p -> top-k -> top-p -> draw (or argmax when greedy)

Penalties follow vLLM: repetition_penalty divides positive logits (multiplies negative ones) of every
token seen in the prompt or the output; frequency_penalty subtracts count x penalty and
presence_penalty subtracts the penalty once, for tokens in the output only. Every operation is a
tensor op on the logits' own device, so the same code runs on CPU and CUDA.
"""
from __future__ import annotations

import dataclasses

import torch

from engine.sampling_params import SamplingParams


def needs_processing(p: SamplingParams, has_grammar: bool) -> bool:
    return bool(p.logit_bias) or p.min_tokens > 0 or p.has_penalties or has_grammar


@dataclasses.dataclass(frozen=True)
class RowContext:
    """What the processors need to know about one request besides its params."""
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    min_tokens_masked: tuple[int, ...] = ()  # eos + stop ids, masked while output < min_tokens
    allowed: torch.Tensor | None = None  # [vocab] bool from the request's grammar, None = no grammar


def apply_processors(logits: torch.Tensor, params: list[SamplingParams],
                     contexts: list[RowContext | None]) -> torch.Tensor:
    """logits: [N, vocab] fp32 -> a processed copy (the input is left alone for raw logprobs).
    A None context: the row has nothing to apply."""
    out = logits.clone()
    vocab = out.shape[-1]
    for i, (p, ctx) in enumerate(zip(params, contexts)):
        if ctx is None:
            continue
        row = out[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long, device=out.device)
            bias = torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=out.dtype, device=out.device)
            row.index_add_(0, ids, bias)
        if len(ctx.output_ids) < p.min_tokens and ctx.min_tokens_masked:
            masked = [t for t in ctx.min_tokens_masked if t < vocab]
            row[torch.tensor(masked, dtype=torch.long, device=out.device)] = float("-inf")
        if p.has_penalties:
            _penalize(row, p, ctx, vocab)
        if ctx.allowed is not None:
            row.masked_fill_(~ctx.allowed.to(out.device), float("-inf"))
    return out


def _penalize(row: torch.Tensor, p: SamplingParams, ctx: RowContext, vocab: int) -> None:
    device = row.device
    if p.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = ctx.prompt_ids + ctx.output_ids
        if ids:
            seen[torch.tensor(ids, dtype=torch.long, device=device)] = True
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, scaled, row))
    if (p.frequency_penalty != 0 or p.presence_penalty != 0) and ctx.output_ids:
        counts = torch.zeros(vocab, dtype=row.dtype, device=device)
        counts.index_add_(0, torch.tensor(ctx.output_ids, dtype=torch.long, device=device),
                          torch.ones(len(ctx.output_ids), dtype=row.dtype, device=device))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def min_p_filter(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """probs: [N, vocab] after temperature -> renormalized probs without tokens below min_p x max."""
    if all(m == 0 for m in min_p):
        return probs
    threshold = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1) * probs.amax(-1, keepdim=True)
    kept = probs.masked_fill(probs < threshold, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)
