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
layers it holds quantized and the wall-clock time they were taken. A request needs the blocks admission reserves for it: its prompt
plus the output reservation (capped by its max_tokens). The router subtracts the blocks of the
requests it has itself sent there since the stats were taken, so a burst does not all land on the
replica that looked emptiest a moment ago (limit: each ingress replica's router counts only its own
sends; the next stats, every `request_routing_stats_period_s`, include everyone's). Then:

    fits: nothing waiting there and headroom >= the request's blocks; unmorphed: no layer quantized
    comfortable: its headroom after the request still holds `spare_requests` more of its size
            (it will not need to morph for this one)
    rank 1: unmorphed replicas that fit comfortably; among them Serve takes the shortest queue
    rank 2: unmorphed replicas that fit only tightly (the shortest queue again)
    rank 3, 4: replicas that fit but hold quantized layers, comfortable then tight: sending them
            less lets their KV drain so they restore (and give fleet budget back) sooner
    then:   the others, one rank each, most headroom first, fewer waiting first on a tie
    stale or missing stats for any candidate, or a call other than `generate`:
            Serve's default, power of two choices (the parent class)

Decisions are counted in `morphserve_router_decisions{decision}`.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Hashable

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

ROUTER_IMPORT_PATH = "deployments.router:PressureAwareRouter"
DECISIONS_METRIC = "morphserve_router_decisions"  # counter, tag `decision`
STATS_KIND = "morphserve-kv"  # marks stats this router understands
Decision = str  # "admits" | "kv_full" | "stale" | "other_call"


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """One replica's routing stats, as its record_routing_stats() reported them."""
    free_blocks: int  # KV blocks a new request may take: free, net of running and waiting demand
    num_waiting: int  # requests the engine has not admitted yet
    block_size: int  # tokens per KV block
    taken_at: float  # wall clock (time.time) when read
    reservation_tokens: int = 0  # output tokens admission reserves per request (engine/demand.py)
    num_quantized: int = 0  # layers it holds quantized now (> 0: it would rather restore than take more)

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
                  now: float, stale_after_s: float, max_tokens: int | None = None,
                  spare_requests: int = 1) -> tuple[Decision, list[list[Hashable]]]:
    """Pure: the ranks for one request, or ("stale", []) when any load is missing or older than
    `stale_after_s`. `sent_blocks`: blocks this router sent to each replica after its stats."""
    if not loads or any(load is None or now - load.taken_at > stale_after_s for load in loads.values()):
        return "stale", []
    headroom = {rid: load.free_blocks - sent_blocks.get(rid, 0) for rid, load in loads.items()}
    need = {rid: max(1, load.blocks_for(prompt_tokens, max_tokens)) for rid, load in loads.items()}
    fits = [rid for rid, load in loads.items() if load.num_waiting == 0 and headroom[rid] >= need[rid]]
    groups: dict[tuple[bool, bool], list[Hashable]] = collections.defaultdict(list)
    for rid in fits:  # (morphed, tight): False sorts first
        tight = headroom[rid] - need[rid] < spare_requests * need[rid]
        groups[(loads[rid].num_quantized > 0, tight)].append(rid)
    rest = sorted((rid for rid in loads if rid not in fits), key=lambda rid: (-headroom[rid], loads[rid].num_waiting))
    ranks = [groups[key] for key in sorted(groups)] + [[rid] for rid in rest]
    return ("admits" if fits else "kv_full"), ranks


class PressureAwareRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, stale_after_s: float = 2.0, spare_requests: int = 1, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.stale_after_s, self.spare_requests = stale_after_s, spare_requests
        self._sent: dict[Any, collections.deque[tuple[float, int]]] = collections.defaultdict(collections.deque)
        self._decisions = None  # the counter, made on first use inside the ingress replica

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        request = _generate_request(pending_request)
        if request is None:
            self._count("other_call")
            return await super().choose_replicas(candidate_replicas, pending_request)
        now = time.time()
        loads = {r.replica_id: ReplicaLoad.from_stats(r.routing_stats) for r in candidate_replicas}
        sent = {rid: self._sent_since(rid, load.taken_at) for rid, load in loads.items() if load is not None}
        decision, ranks = rank_replicas(loads, len(request.prompt_token_ids), sent, now, self.stale_after_s,
                                        request.max_tokens, self.spare_requests)
        self._count(decision)
        if decision == "stale":
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        request = _generate_request(pending_request)
        stats = self._replicas.get(replica_id)
        load = ReplicaLoad.from_stats(stats.routing_stats) if stats is not None else None
        if request is None or load is None:
            return
        sent, now = self._sent[replica_id], time.time()
        sent.append((now, load.blocks_for(len(request.prompt_token_ids), request.max_tokens)))
        while sent and now - sent[0][0] > 2 * self.stale_after_s:  # older than any stats we would use
            sent.popleft()

    def _sent_since(self, replica_id: Any, taken_at: float) -> int:
        return sum(blocks for at, blocks in self._sent.get(replica_id, ()) if at >= taken_at)

    def _count(self, decision: Decision) -> None:
        try:
            if self._decisions is None:
                from deployments.metrics import default_backend

                self._decisions = default_backend().counter(
                    DECISIONS_METRIC, "Engine-replica routing decisions of the pressure-aware router", ("decision",))
            self._decisions.inc(1, {"decision": decision})
        except Exception:  # metrics must never break routing
            pass


def _generate_request(pending_request: Any) -> Any:
    """The GenerateRequest of a `generate` call (what KV admission is about), else None."""
    if pending_request is None or getattr(pending_request.metadata, "call_method", None) != "generate":
        return None
    request = pending_request.args[0] if pending_request.args else None
    return request if hasattr(request, "prompt_token_ids") else None
