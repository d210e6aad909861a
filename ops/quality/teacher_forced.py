"""Teacher-forced top-1 agreement: along the tokens a system actually served, the fraction of
positions where the full-precision model, given the same prefix (prompt + served tokens so far),
would have chosen the same next token. Unlike ROUGE-L between two free-running generations, one early
flip costs one position, not the whole rest of the answer.

The full-precision model runs offline once over every prompt + served sequence, several sequences per
forward pass: sequences are sorted by length and right-padded to the longest of their batch (attention
is causal, so padding after a sequence never changes its positions), and logits are computed only at
the positions that predict a served token.

Also: token-weighted perplexity of the configurations a dynamic system served with: every served
token is attributed to the configuration (precision of each layer) in force when it was streamed, and
the perplexities are combined as exp(sum_k n_k ln ppl_k / sum_k n_k), i.e. the mean NLL per token.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Callable, Mapping, Sequence

import torch

# tokens: [B, S] long -> hidden states [B * S, H] (the model's final layer output, before its norm)
HiddenFn = Callable[[torch.Tensor], torch.Tensor]
LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # hidden [N, H] -> logits [N, V]


@dataclasses.dataclass(frozen=True)
class ForcedSequence:
    key: str  # e.g. "<run>/<request id>"
    prompt_ids: tuple[int, ...]
    served_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Agreement:
    matches: int
    positions: int

    @property
    def rate(self) -> float | None:
        return self.matches / self.positions if self.positions else None


def predictions(hidden_fn: HiddenFn, logits_fn: LogitsFn, seqs: Sequence[ForcedSequence],
                max_batch_tokens: int = 4096) -> dict[str, tuple[int, ...]]:
    """key -> the model's argmax next token at every served position (len(served_ids) values)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].prompt_ids) + len(seqs[i].served_ids))
    out: dict[str, tuple[int, ...]] = {}
    start = 0
    while start < len(order):
        longest = len(seqs[order[start]].prompt_ids) + len(seqs[order[start]].served_ids)
        stop = start + 1
        while stop < len(order):  # grow the batch while padded tokens stay within the budget
            length = len(seqs[order[stop]].prompt_ids) + len(seqs[order[stop]].served_ids)
            if (stop - start + 1) * length > max_batch_tokens:
                break
            longest, stop = length, stop + 1
        out.update(_batch_predictions(hidden_fn, logits_fn, [seqs[i] for i in order[start:stop]], longest))
        start = stop
    return out


def _batch_predictions(hidden_fn: HiddenFn, logits_fn: LogitsFn, batch: Sequence[ForcedSequence],
                       length: int) -> dict[str, tuple[int, ...]]:
    tokens = torch.zeros(len(batch), length, dtype=torch.long)
    rows: list[int] = []  # flat positions whose next-token prediction we need
    for b, s in enumerate(batch):
        ids = (*s.prompt_ids, *s.served_ids)
        tokens[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        first = b * length + len(s.prompt_ids) - 1  # the last prompt position predicts served token 0
        rows += range(first, first + len(s.served_ids))
    with torch.inference_mode():
        hidden = hidden_fn(tokens)
        best = logits_fn(hidden[torch.tensor(rows, dtype=torch.long)]).argmax(dim=-1).tolist()
    out, at = {}, 0
    for s in batch:
        out[s.key] = tuple(best[at:at + len(s.served_ids)])
        at += len(s.served_ids)
    return out


def agreement(seq: ForcedSequence, predicted: Sequence[int]) -> Agreement:
    if len(predicted) != len(seq.served_ids):
        raise ValueError(f"{seq.key}: {len(predicted)} predictions for {len(seq.served_ids)} served tokens")
    return Agreement(sum(p == s for p, s in zip(predicted, seq.served_ids)), len(seq.served_ids))


def pooled(agreements: Sequence[Agreement]) -> Agreement:
    return Agreement(sum(a.matches for a in agreements), sum(a.positions for a in agreements))


def tokens_by_config(token_times: Sequence[float], config_times: Sequence[float],
                     configs: Sequence[str]) -> dict[str, int]:
    """Attribute each token (its stream time) to the configuration in force then: the last change at
    or before it (the first known configuration for tokens before any)."""
    if not configs or len(configs) != len(config_times):
        raise ValueError("need one configuration per change time, and at least one")
    counts: dict[str, int] = {}
    for t in token_times:
        i = max(bisect.bisect_right(config_times, t) - 1, 0)
        counts[configs[i]] = counts.get(configs[i], 0) + 1
    return counts


def token_weighted_perplexity(perplexities: Mapping[str, float], token_counts: Mapping[str, int]) -> float | None:
    """exp(sum n_k ln ppl_k / sum n_k) over the configurations that served tokens."""
    total = sum(token_counts.values())
    if total == 0:
        return None
    missing = [k for k, n in token_counts.items() if n and k not in perplexities]
    if missing:
        raise ValueError(f"no perplexity for configuration(s) {missing}")
    return math.exp(sum(n * math.log(perplexities[k]) for k, n in token_counts.items() if n) / total)
