"""Isolating the request that makes a step fail, so that one request's fault harms no other.

A step runs its chunks as one batch. When that raises, each chunk runs again alone: the request(s)
that still fail are reported, the others go on. Every row is computed from its own tokens, KV and
generator only (batch invariance: engine/sampler.py, tests/test_engine.py), so the survivors'
tokens are the ones a run without the culprit would give. Before the retry the random generators
are rewound, since the failed batch may have drawn from them; the KV slots the failed batch wrote
are rewritten by the retry with the same values. Nothing else may change before the results are
committed (LLMEngine._commit).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from engine.batch import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)

# (chunk, sampled token, or None when the chunk ends before its request's last known token)
Sampled = tuple[ScheduledChunk, Optional[int]]


def forward_isolating(out: SchedulerOutput, forward: Callable[[SchedulerOutput], list[Sampled]],
                      generators: list[torch.Generator | None]) -> tuple[list[Sampled], list[tuple[str, Exception]]]:
    """`forward(out)` (model + sampler, no other side effects) as one batch, else chunk by chunk.
    Returns what was sampled and (request_id, error) for each request that failed alone."""
    rewind = [(g, g.get_state()) for g in generators if g is not None]
    try:
        return forward(out), []
    except Exception as e:  # noqa: BLE001 - any fault: find the request(s) it belongs to
        logger.warning("engine step over %d requests failed (%s: %s); retrying them one at a time",
                       len(out.chunks), type(e).__name__, e)
    for generator, state in rewind:
        generator.set_state(state)
    sampled: list[Sampled] = []
    failed: list[tuple[str, Exception]] = []
    for chunk in out.chunks:
        try:
            sampled += forward(SchedulerOutput((chunk,)))
        except Exception as e:  # noqa: BLE001 - this request alone fails
            logger.exception("request %s fails the engine step alone; aborting it", chunk.request_id)
            failed.append((chunk.request_id, e))
    return sampled, failed
