"""What a step computes for a request besides its next token, when the request asks for it:
logprobs of sampled tokens, logprobs of prompt tokens (echo / log-likelihood), the grammar mask of
structured output, and the history the logits processors read.

Split in two like the step itself: `compute_*` only read (a step that raises may be retried, so
nothing is advanced there) and `commit_extras` advances the request's state once the step is kept.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence as Seq

import torch

from engine.batch import ScheduledChunk
from engine.logits_processors import RowContext, needs_processing
from engine.logprobs import PositionLogprobs, position_logprobs
from engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class ChunkResult:
    """One scheduled chunk after the model and sampler ran (nothing committed yet)."""
    chunk: ScheduledChunk
    token: int | None  # None: the chunk ends inside the prompt (no token sampled)
    logprobs: PositionLogprobs | None = None
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()  # positions len(seq.prompt_logprobs) + 1 ...


def row_context(seq: Sequence) -> RowContext | None:
    if not needs_processing(seq.params, seq.grammar is not None):
        return None
    stop_ids = tuple(sorted(seq.stop_checker.stop_ids)) if seq.stop_checker is not None else ()
    return RowContext(prompt_ids=seq.prompt_token_ids, output_ids=tuple(seq.output_token_ids),
                      min_tokens_masked=stop_ids, allowed=seq.grammar.allowed() if seq.grammar else None)


def _missing_prompt_positions(seq: Sequence, chunk: ScheduledChunk) -> range:
    """Prompt positions whose logprob this chunk's rows give and that are not known yet. Row r of
    the chunk (position start_pos + r) predicts position start_pos + r + 1."""
    if seq.params.prompt_logprobs is None:
        return range(0)
    first = max(chunk.start_pos + 1, len(seq.prompt_logprobs), 1)  # [0] is None once started
    return range(first, min(chunk.end_pos, seq.num_prompt_tokens - 1) + 1)


def chunks_needing_every_row(chunks: Seq[ScheduledChunk], requests: Mapping[str, Sequence]) -> list[int]:
    return [i for i, c in enumerate(chunks) if _missing_prompt_positions(requests[c.request_id], c)]


def compute_prompt_logprobs(seq: Sequence, chunk: ScheduledChunk, every_row: torch.Tensor,
                            decode: Callable[[int], str]) -> tuple[PositionLogprobs, ...]:
    positions = _missing_prompt_positions(seq, chunk)
    if not positions:
        return ()
    rows = every_row[positions.start - 1 - chunk.start_pos:positions.stop - 1 - chunk.start_pos]
    chosen = [seq.prompt_token_ids[p] for p in positions]
    return tuple(position_logprobs(rows, chosen, [seq.params.prompt_logprobs] * len(chosen), decode))


def compute_sampled_logprobs(logits: torch.Tensor, seqs: Seq[Sequence], tokens: Seq[int],
                             decode: Callable[[int], str]) -> list[PositionLogprobs | None]:
    """logits: the raw [N, vocab] rows the tokens were sampled from (before any processor)."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[PositionLogprobs | None] = [None] * len(seqs)
    if rows:
        index = torch.tensor(rows, device=logits.device)
        computed = position_logprobs(logits.index_select(0, index), [tokens[i] for i in rows],
                                     [seqs[i].params.logprobs for i in rows], decode)
        for i, lp in zip(rows, computed):
            out[i] = lp
    return out


def commit_extras(seq: Sequence, result: ChunkResult) -> None:
    """Keep what the step computed: prompt logprobs, the sampled token's logprob, the grammar's advance."""
    if seq.params.prompt_logprobs is not None and result.prompt_logprobs:
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # position 0: nothing precedes it
        seq.prompt_logprobs.extend(result.prompt_logprobs)
    if result.token is None:
        return
    if result.logprobs is not None:
        seq.pending_logprobs.append(result.logprobs)
    if seq.grammar is not None:
        seq.grammar.accept(result.token)
