"""PressureAwareRouter: Ray Serve's request router for the engine replicas, by free KV memory.

Ray Serve 2.60's custom request-router API: a deployment names a `RequestRouter` subclass in its
`request_router_config`; every DeploymentHandle to it (here: the ingress's) routes each request by
asking `choose_replicas(candidates, pending_request)` for ranked lists of replicas, and Serve picks
the replica with the shortest queue within the first rank that accepts. Each replica's
`record_routing_stats()` (LLMServer) is pulled by Serve every `request_routing_stats_period_s` and
reaches the router as `replica.routing_stats`.

A replica's stats are its latest pressure figures: the KV blocks a new request may take (free blocks
net of demand: less what running requests are still owed inside their output reservation and what
the waiting queue needs, engine/demand.py), waiting requests, block size, output reservation, the
layers it holds quantized, and the wall-clock time of the step boundary they describe. A request
needs the blocks admission reserves for it: its prompt plus the output reservation (capped by its
max_tokens). The router subtracts the blocks of the requests it has itself sent there since that
time (its in-flight count; a fresh report resets it, as the report then includes them), so a burst
does not all land on the replica that looked emptiest at the last report (limit: each ingress
replica's router counts only its own sends; the next stats, every `request_routing_stats_period_s`,
include everyone's). Then:

    admits: nothing waiting there and headroom >= the request's blocks (it starts without a morph)
    rank 1: the replicas that admit, at most two drawn at random (power of two choices, as Serve's
            default router); Serve takes the shorter queue (its queue-length cache / probe), and on
            equal queues the first listed: an unmorphed replica before a morphed one (sending the
            morphed one less lets it restore sooner), then the one with more headroom
    rank 2: the other replicas that admit, in the same order (used only when rank 1's queues are full)
    then:   the replicas that cannot admit it now (used only when the queues above are full)
    none admits it: one rank of all, Serve's shortest queue as its default router would choose (it
            waits wherever it goes); most headroom, then fewer waiting, first on equal queues. Ranking
            by headroom here would feed a loop: a replica that morphed has the most headroom, takes
            the load, and stays morphed.
    stale or missing stats for any candidate, or a call other than `generate`:
            Serve's default, power of two choices (the parent class)

Why headroom and morph state only filter and break ties: both change only at the next report, so a
rank built on them sends a run of requests to the same replica between two reports, while Serve's
queue length changes at every send and completion. And a replica that morphed gains headroom, so
ranking by it draws load to that replica and keeps it morphed.

Decisions are counted in `morphserve_router_decisions{decision}`, the chosen replica of every
`generate` call in `morphserve_router_choices{engine_replica}`.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import random
import time
from typing import Any, Hashable

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

ROUTER_IMPORT_PATH = "deployments.router:PressureAwareRouter"
DECISIONS_METRIC = "morphserve_router_decisions"  # counter, tag `decision`
CHOICES_METRIC = "morphserve_router_choices"  # counter, tag `engine_replica` (Serve reserves `replica`)
STATS_KIND = "morphserve-kv"  # marks stats this router understands
Decision = str  # "admits" | "kv_full" | "stale" | "other_call"


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """One replica's routing stats, as its record_routing_stats() reported them."""
    free_blocks: int  # KV blocks a new request may take: free, net of running and waiting demand
    num_waiting: int  # requests the engine has not admitted yet
    block_size: int  # tokens per KV block
    taken_at: float  # wall clock (time.time) of the step boundary the figures describe
    reservation_tokens: int = 0  # output tokens admission reserves per request (engine/demand.py)
    num_quantized: int = 0  # layers it holds quantized now (> 0: listed after unmorphed ones, for ties)

    def blocks_for(self, prompt_tokens: int, max_tokens: int | None = None) -> int:
        """Blocks admission reserves for a request: prompt + min(max_tokens, reservation)."""
        output = self.reservation_tokens if max_tokens is None else min(max_tokens, self.reservation_tokens)
        return math.ceil(max(1, prompt_tokens + max(0, output)) / self.block_size)

    def to_stats(self) -> dict[str, Any]:
        return {"kind": STATS_KIND, **dataclasses.asdict(self)}

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> "ReplicaLoad | None":
        if not stats or stats.get("kind") != STATS_KIND:
            return None
        try:
            return cls(int(stats["free_blocks"]), int(stats["num_waiting"]), max(1, int(stats["block_size"])),
                       float(stats["taken_at"]), int(stats.get("reservation_tokens", 0)),
                       int(stats.get("num_quantized", 0)))
        except (KeyError, TypeError, ValueError):
            return None


def rank_replicas(loads: dict[Hashable, ReplicaLoad | None], prompt_tokens: int, sent_blocks: dict[Hashable, int],
                  now: float, stale_after_s: float, max_tokens: int | None = None) -> tuple[Decision, list[list[Hashable]]]:
    """Pure: ("admits", [the replicas that admit the request now, in tie-break order], [the others]),
    ("kv_full", [every replica, most headroom first]) when none admits it, or ("stale", []) when any
    load is missing or older than `stale_after_s`. `sent_blocks`: blocks this router sent to each replica
    after its stats were taken. Serve picks the shortest queue within the first rank that accepts."""
    if not loads or any(load is None or now - load.taken_at > stale_after_s for load in loads.values()):
        return "stale", []
    headroom = {rid: load.free_blocks - sent_blocks.get(rid, 0) for rid, load in loads.items()}
    admits = [rid for rid, load in loads.items()
              if load.num_waiting == 0 and headroom[rid] >= max(1, load.blocks_for(prompt_tokens, max_tokens))]
    admits.sort(key=lambda rid: (loads[rid].num_quantized > 0, -headroom[rid]))  # ties only: Serve sorts by queue
    rest = sorted((rid for rid in loads if rid not in admits), key=lambda rid: (-headroom[rid], loads[rid].num_waiting))
    if not admits:  # it waits wherever it goes: the shortest queue, as Serve's default (headroom on a tie)
        return "kv_full", [rest]
    return "admits", [admits, rest] if rest else [admits]


def two_choices(rank: list[Hashable], rng: random.Random) -> list[list[Hashable]]:
    """Power of two choices within one rank: two members drawn at random (kept in the rank's order)
    first, the others as the next rank; a rank of two or fewer is left whole."""
    if len(rank) <= 2:
        return [rank]
    drawn = set(rng.sample(range(len(rank)), 2))
    return [[rid for i, rid in enumerate(rank) if i in drawn], [rid for i, rid in enumerate(rank) if i not in drawn]]


class InFlight:
    """The blocks this router sent to each replica, by when (router wall clock), kept for `keep_s`:
    those sent after a replica's stats were taken are not in them yet."""

    def __init__(self, keep_s: float):
        self.keep_s = keep_s
        self._sent: dict[Hashable, collections.deque[tuple[float, int]]] = collections.defaultdict(collections.deque)

    def record(self, replica_id: Hashable, at: float, blocks: int) -> None:
        sent = self._sent[replica_id]
        sent.append((at, blocks))
        while sent and at - sent[0][0] > self.keep_s:  # older than any stats the router would still use
            sent.popleft()

    def since(self, replica_id: Hashable, taken_at: float) -> int:
        """Blocks sent there after `taken_at`: a fresh report resets this to what followed it."""
        return sum(blocks for at, blocks in self._sent.get(replica_id, ()) if at >= taken_at)


class PressureAwareRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, stale_after_s: float = 2.0, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.stale_after_s = stale_after_s
        self._in_flight = InFlight(keep_s=2 * stale_after_s)
        self._rng = random.Random()
        self._decisions = self._choices = None  # the counters, made on first use inside the ingress replica

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        request = _generate_request(pending_request)
        if request is None:
            self._count("other_call")
            return await super().choose_replicas(candidate_replicas, pending_request)
        now = time.time()
        loads = {r.replica_id: ReplicaLoad.from_stats(r.routing_stats) for r in candidate_replicas}
        sent = {rid: self._in_flight.since(rid, load.taken_at) for rid, load in loads.items() if load is not None}
        decision, ranks = rank_replicas(loads, len(request.prompt_token_ids), sent, now, self.stale_after_s,
                                        request.max_tokens)
        self._count(decision)
        if decision == "stale":
            return await super().choose_replicas(candidate_replicas, pending_request)
        ranks = two_choices(ranks[0], self._rng) + ranks[1:]
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        request = _generate_request(pending_request)
        if request is None:
            return
        self._count_choice(replica_id)
        stats = self._replicas.get(replica_id)
        load = ReplicaLoad.from_stats(stats.routing_stats) if stats is not None else None
        if load is None:
            return
        self._in_flight.record(replica_id, time.time(), load.blocks_for(len(request.prompt_token_ids), request.max_tokens))

    def _count(self, decision: Decision) -> None:
        try:
            if self._decisions is None:
                from deployments.metrics import default_backend

                self._decisions = default_backend().counter(
                    DECISIONS_METRIC, "Engine-replica routing decisions of the pressure-aware router", ("decision",))
            self._decisions.inc(1, {"decision": decision})
        except Exception:  # metrics must never break routing
            pass

    def _count_choice(self, replica_id: Any) -> None:
        try:
            if self._choices is None:
                from deployments.metrics import default_backend

                self._choices = default_backend().counter(
                    CHOICES_METRIC, "Generate calls the pressure-aware router sent to each engine replica", ("engine_replica",))
            self._choices.inc(1, {"engine_replica": str(getattr(replica_id, "unique_id", replica_id))})
        except Exception:  # metrics must never break routing
            pass


def _generate_request(pending_request: Any) -> Any:
    """The GenerateRequest of a `generate` call (what KV admission is about), else None."""
    if pending_request is None or getattr(pending_request.metadata, "call_method", None) != "generate":
        return None
    request = pending_request.args[0] if pending_request.args else None
    return request if hasattr(request, "prompt_token_ids") else None
