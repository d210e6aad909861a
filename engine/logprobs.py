"""Log-probabilities the engine returns: per sampled token (`logprobs`) and per prompt token
(`prompt_logprobs`, for echo / log-likelihood scoring).

They are vLLM's default "raw" logprobs: the log-softmax of the model's logits as they come out of
the model, before penalties, logit bias, the grammar mask, temperature, top-k/top-p/min-p. So they
score the model, not the sampling settings, and a prompt's logprobs equal the sampled ones for
the same prefix.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token (vLLM's rank)
    token: str = ""  # the token decoded alone (special tokens kept), as vLLM reports it


@dataclasses.dataclass(frozen=True)
class PositionLogprobs:
    """One position: the token that is there (sampled or given) and the `k` most likely ones."""
    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...]  # most likely first, len = the k asked for


def position_logprobs(logits: torch.Tensor, chosen: list[int], k: list[int],
                      decode: Callable[[int], str] = lambda _: "") -> list[PositionLogprobs]:
    """logits: [N, vocab] raw model logits; chosen[i]: the token at row i; k[i]: how many top tokens."""
    if logits.shape[0] != len(chosen) or len(chosen) != len(k):
        raise ValueError(f"position_logprobs got {logits.shape[0]} rows for {len(chosen)} tokens")
    if not chosen:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
    ids = torch.tensor(chosen, device=logits.device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, ids)  # [N, 1]
    # rank = 1 + how many tokens are strictly more likely (vLLM's definition)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(max(k), dim=-1) if max(k) > 0 else (logprobs[:, :0], ids[:, :0])
    chosen_lp, ranks, top_lp, top_ids = (t.cpu().tolist() for t in (chosen_lp, ranks, top_lp, top_ids))
    return [PositionLogprobs(TokenLogprob(chosen[i], chosen_lp[i][0], ranks[i], decode(chosen[i])),
                             tuple(TokenLogprob(top_ids[i][j], top_lp[i][j], j + 1, decode(top_ids[i][j]))
                                   for j in range(k[i])))
            for i in range(len(chosen))]
