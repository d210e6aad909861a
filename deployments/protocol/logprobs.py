"""Engine logprobs -> OpenAI's two logprobs shapes.

/v1/completions (the legacy shape): {"tokens", "token_logprobs", "top_logprobs", "text_offset"},
one entry per token; with echo the prompt's tokens come first and the first one has null
logprob and top_logprobs (nothing precedes it). /v1/chat/completions: {"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}]}. Token strings are each token decoded alone, as vLLM
reports them; the values are the model's raw log-probabilities (engine/logprobs.py).
"""
from __future__ import annotations

from typing import Sequence

from engine.logprobs import PositionLogprobs


def completion_logprobs(positions: Sequence[PositionLogprobs | None], text_offset: int = 0,
                        first_token: str = "") -> dict:
    """first_token: the text of the first prompt token (echo), whose position has no logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for pos in positions:
        if pos is None:  # the first prompt token
            tokens.append(first_token)
            token_lps.append(None)
            tops.append(None)
        else:
            tokens.append(pos.chosen.token)
            token_lps.append(pos.chosen.logprob)
            top = {t.token: t.logprob for t in pos.top}
            top.setdefault(pos.chosen.token, pos.chosen.logprob)  # vLLM lists the chosen token too
            tops.append(top)
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(positions: Sequence[PositionLogprobs]) -> dict:
    return {"content": [{**_entry(p.chosen.token, p.chosen.logprob),
                         "top_logprobs": [_entry(t.token, t.logprob) for t in p.top]} for p in positions]}
