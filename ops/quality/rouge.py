"""ROUGE-L F1 (no dependency) and per-request agreement between two sets of responses.

Tokens: lowercase runs of word characters (`\\w+`, so letters of any script and digits); whitespace
and punctuation only separate tokens, as in the usual ROUGE tokenization. ROUGE-L uses the longest
common subsequence (LCS) of the two token lists: P = LCS/len(candidate), R = LCS/len(reference),
F1 = 2PR/(P+R). Two empty texts agree fully (1.0); one empty text scores 0.
"""
from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Mapping, Sequence

_TOKEN = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """LCS length by the bit-parallel method (one big-integer row over `a`, one update per token
    of `b`): O(len(a) * len(b) / word size), fast enough for thousands of long responses.

    After each token of b, the zero bits of `row` mark, for k = 1, 2, ..., the leftmost position of
    a where a common subsequence of length k can end (Allison-Dix / Hyyro); the adding carry moves
    each mark to the next unused match. The number of zero bits is the LCS length."""
    if not a or not b:
        return 0
    matches: dict[str, int] = {}
    for i, token in enumerate(a):
        matches[token] = matches.get(token, 0) | (1 << i)
    full = (1 << len(a)) - 1
    row = full
    for token in b:
        m = matches.get(token)
        if m is None:
            continue
        hit = row & m
        row = ((row + hit) | (row - hit)) & full
    return len(a) - row.bit_count()


def rouge_l_f1(candidate: str, reference: str) -> float:
    c, r = tokenize(candidate), tokenize(reference)
    if not c and not r:
        return 1.0
    lcs = lcs_length(c, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(c), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


@dataclasses.dataclass(frozen=True)
class Agreement:
    """ROUGE-L F1 of one system's responses against references, request by request."""
    mean: float | None  # over every request that has a reference (missing responses score 0)
    n_scored: int  # requests with both a response and a reference
    n_missing: int  # requests with a reference but no response (failed); counted as 0
    per_request: Mapping[str, float]


def agreement(responses: Mapping[str, str], references: Mapping[str, str]) -> Agreement:
    """Score `responses` (request id -> text) against `references` (request id -> text). A request
    the system failed has no response; it scores 0 so a system cannot gain quality by failing."""
    scores: dict[str, float] = {}
    missing = 0
    for request_id, reference in references.items():
        response = responses.get(request_id)
        if response is None:
            missing += 1
            scores[request_id] = 0.0
        else:
            scores[request_id] = rouge_l_f1(response, reference)
    mean = statistics.fmean(scores.values()) if scores else None
    return Agreement(mean=mean, n_scored=len(scores) - missing, n_missing=missing, per_request=scores)


def quality_loss_reduction(loss: float | None, baseline_loss: float | None) -> float | None:
    """1 - loss / baseline_loss: 1.0 = no loss at all, 0.0 = as lossy as the baseline (static INT4).
    None when either is unknown or the baseline lost nothing (the ratio means nothing then)."""
    if loss is None or baseline_loss is None or baseline_loss <= 0:
        return None
    return 1.0 - loss / baseline_loss
