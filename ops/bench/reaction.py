"""Reaction time: how long a burst's first request that did not fit in the KV cache waited until
the cache admitted it.

For every request (client records): arrival a = its send time; need = ceil((prompt tokens +
reservation) / block size) blocks (the server's usage.prompt_tokens when it reports them, the chat
template included; the reservation for output the engine admits with, when its status reports one);
admitted = a + the server's queue time when it reports one, else its first token (an upper bound that
also holds the prefill).

KV in use at time t is rebuilt from the records, not from the sampled status (which is up to one
sampling interval old): every admitted, unfinished request holds ceil((prompt + tokens streamed so
far) / block size) blocks. KV capacity is the sampled server value (step function; the last sample at
or before t), or the system's fixed capacity when the server does not report it.

A request did not fit when, at its arrival, used + need > capacity, and it then waited longer than
`stall_threshold_s`. An episode starts at such a request and lasts while requests that arrived
during it are still waiting. Its reaction time runs from that first arrival to the earlier of (a) its
admission, (b) the first sample whose capacity could hold the blocks in use at its arrival plus its
need (morphing made room; the sample time is when it was seen, so an upper bound too).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from typing import Sequence

from ops.bench.loadgen import RequestRecord, ServerSample


@dataclasses.dataclass(frozen=True)
class Episode:
    first_request: str
    first_arrival_s: float
    reacted_s: float  # when the first request was admitted or capacity could admit it
    by: str  # "capacity" (morphing made room first) or "admission"
    capacity_at_arrival: int
    blocks_needed: int  # in use at its arrival + its own need
    num_waiting: int  # requests of the episode that waited

    @property
    def reaction_s(self) -> float:
        return self.reacted_s - self.first_arrival_s


@dataclasses.dataclass(frozen=True)
class ReactionSummary:
    episodes: tuple[Episode, ...]
    admission_source: str  # "server queue time" or "first token (upper bound)"

    @property
    def median_s(self) -> float | None:
        return statistics.median(e.reaction_s for e in self.episodes) if self.episodes else None

    @property
    def max_s(self) -> float | None:
        return max((e.reaction_s for e in self.episodes), default=None)


def engine_blocked_waits(samples: Sequence[ServerSample]) -> tuple[float, ...]:
    """The engine's own account, where its status reports it (admission.last_blocked_for_s): how long
    each head of the queue that did not fit waited, one value per change seen in the samples."""
    out: list[float] = []
    last = None
    for s in sorted(samples, key=lambda s: s.t_s):
        value = s.values.get("last_blocked_for_s")
        if value is not None and value != last:
            out.append(value)
        last = value if value is not None else last
    return tuple(out)


def admitted_at(r: RequestRecord) -> float | None:
    if not r.ok:
        return None
    return r.sent_s + r.queue_s if r.queue_s is not None else r.first_token_s


def _blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


class _KVUse:
    """Blocks in use at time t, rebuilt from the ok records."""

    def __init__(self, records: Sequence[RequestRecord], block_size: int):
        self.block_size = block_size
        self.spans = [(admitted_at(r), r.end_s, _prompt(r), r.token_times_s) for r in records if r.ok]

    def at(self, t: float) -> int:
        used = 0
        for start, end, prompt, times in self.spans:
            if start <= t < end:
                used += _blocks(prompt + bisect.bisect_right(times, t), self.block_size)
        return used


def _prompt(r: RequestRecord) -> int:
    return r.served_prompt_tokens if r.served_prompt_tokens is not None else r.prompt_tokens


class _Capacity:
    """KV capacity in blocks over time from the samples, or a fixed value."""

    def __init__(self, samples: Sequence[ServerSample], fixed: int | None):
        points = sorted((s.t_s, int(s.values["kv_capacity_blocks"])) for s in samples
                        if "kv_capacity_blocks" in s.values)
        self.times = [t for t, _ in points]
        self.values = [v for _, v in points]
        self.fixed = fixed

    def at(self, t: float) -> int | None:
        if not self.values:
            return self.fixed
        i = bisect.bisect_right(self.times, t) - 1
        return self.values[max(i, 0)]

    def first_reaching(self, blocks: int, after: float) -> float | None:
        for t, v in zip(self.times, self.values):
            if t > after and v >= blocks:
                return t
        return None


def reaction_times(records: Sequence[RequestRecord], samples: Sequence[ServerSample], block_size: int,
                   fixed_capacity_blocks: int | None = None, stall_threshold_s: float = 0.0,
                   reservation_tokens: int = 0) -> ReactionSummary:
    used, capacity = _KVUse(records, block_size), _Capacity(samples, fixed_capacity_blocks)
    waiting = sorted((r for r in records if r.sent_s is not None), key=lambda r: r.sent_s)
    episodes: list[Episode] = []
    open_until, current = -math.inf, None
    for r in waiting:
        admitted = admitted_at(r)
        waited = math.inf if admitted is None else admitted - r.sent_s
        if current is not None and r.sent_s < open_until:
            if waited > stall_threshold_s:  # joined the queue of the open episode
                current["num_waiting"] += 1
                open_until = max(open_until, math.inf if admitted is None else admitted)
            continue
        if current is not None:
            episodes.append(_close(current))
            current = None
        cap = capacity.at(r.sent_s)
        needed = used.at(r.sent_s) + _blocks(_prompt(r) + reservation_tokens, block_size)
        if cap is None or waited <= stall_threshold_s or needed <= cap:
            continue
        grown = capacity.first_reaching(needed, r.sent_s)
        ends = [t for t in (admitted, grown) if t is not None]
        if not ends:  # never admitted and capacity never grew: the episode lasts to the run's end
            ends = [max((x.end_s for x in records if x.end_s is not None), default=r.sent_s)]
        reacted = min(ends)
        current = {"first_request": r.request_id, "first_arrival_s": r.sent_s, "reacted_s": reacted,
                   "by": "capacity" if grown is not None and grown == reacted else "admission",
                   "capacity_at_arrival": cap, "blocks_needed": needed, "num_waiting": 1}
        open_until = math.inf if admitted is None else admitted
    if current is not None:
        episodes.append(_close(current))
    source = ("server queue time" if any(r.queue_s is not None for r in records if r.ok)
              else "first token (upper bound)")
    return ReactionSummary(episodes=tuple(episodes), admission_source=source)


def _close(fields: dict) -> Episode:
    return Episode(**fields)
