"""PressureAwareRouter: Ray Serve's request router for the engine replicas, by prefill backlog, queue length and KV room.

Ray Serve 2.60's custom request-router API: a deployment names a `RequestRouter` subclass in its
`request_router_config`; every DeploymentHandle to it (here: the ingress's) routes each request by
asking `choose_replicas(candidates, pending_request)` for ranked lists of replicas, and Serve sends
it to the first rank whose replica has room in its queue (shortest queue within a rank). Each
replica's `record_routing_stats()` (LLMServer) is pulled by Serve every
`request_routing_stats_period_s` and reaches the router as `replica.routing_stats`.

A replica's stats are its latest pressure figures: the KV blocks a new request may take (free blocks
net of demand: less what running requests are still owed inside their output reservation and what
the waiting queue needs, engine/demand.py), how many of those its morph added (capacity now less
the capacity at full precision), waiting requests, the prompt tokens it has yet to prefill (its
prefill backlog), block size, output reservation, the layers it holds quantized, and their cutoff:
the wall-clock time up to which requests that reached the engine are in them (the start of the step
they were taken after, AsyncLLMEngine.pressure_with_cutoff). A request needs the blocks admission reserves for it: its
prompt plus the output reservation (capped by its max_tokens). The router counts the requests it has
itself sent there since that cutoff, less the time a request takes to reach the engine (`transit_s`;
its in-flight record: their blocks come off the headroom, their prompts onto the backlog; a fresh
report resets it, as the report then includes them), so a burst does not all land on the replica that
looked emptiest at the last report. (Until wave 18 the figures were dated at the step's *end*: every
request sent during a step, ~0.65 s for a 512-token prefill chunk on one thread, was in neither the
figures nor the count, so in a burst the router saw the replica that was prefilling as emptier than
it was.) A report is also up to a step plus a stats period old, and the replica has kept prefilling
since: its backlog is aged by its recent prefill speed times the report's age (`prefill_tps`, measured
by the engine; the age counts from the step's end, `measured_at`, when the figures were true, not from
the cutoff at its start, which until wave 29 took the step's own prefill off twice), else two replicas
whose reports are of different ages compare figures that lie differently, by up to a period's prefill
(~0.4 s of TTFT at 0.5 s periods), and the burst leans on the one that reported last. Each replica then
falls in a class:

    fits:         nothing waiting there and the request fits in the room it would have at full
                  precision (headroom less its morph's blocks): no morph, and no restore delayed
    fits_morphed: it fits only in the blocks the replica's morph added: no new morph, but the replica
                  stays morphed longer
    no_fit:       it waits or makes the replica morph (admission morphing reacts at once, so the cost
                  is mostly quality: quantized layer-seconds)

Replicas are listed one per rank, cheapest first, and Serve sends to the first whose queue is not
full. While any replica reports a prefill backlog (a burst), cheapest is the least backlog now
(reported + the prompts sent there since - its prefill speed x the report's age); otherwise, and on
equal backlog, the least cost = queue length (Serve's queue-length cache: every send and completion
updates it) plus the class's penalty in queued requests (0, `morphed_penalty`, `no_fit_penalty`; both
0 by default, so the class only breaks ties); then the better class, then more room at full precision.

Why the prefill backlog first: a request's first token waits for every prompt token queued ahead of
it on that replica, so in a burst TTFT (the SLO) follows the backlog, not the count of requests (a
replica decoding six short answers is nearer a new request's first token than one about to prefill
two 256-token prompts); when nothing waits, the backlog is 0 everywhere and queue length decides.
Why queue length before KV: TTFT and TPOT follow how many requests share a
replica's steps, and admission morphing makes a request that does not fit wait ~0 ms; a KV filter
that overrides the queue (the first version) piled bursts onto one replica (busiest share 0.53 vs
0.51, TPOT P50 +17% in the wave-7 fleet benchmark), and penalties of 1 and 2 queued requests still
cost TPOT P50 +9% against Serve's router (wave 8, 5 repeats) where 0 and 0 cost +3% (3 repeats) for
the same cut in quantized layer-seconds. Ties are frequent (two replicas often hold equal queues).
And why room at full precision: a replica that morphed has the most headroom, so ranking by headroom
draws load to it and keeps it morphed; counted at full precision, a morphed replica drains and
restores sooner.

    stale or missing stats for any candidate, a replica without a cached queue length, or a call
    other than `generate`: Serve's default, power of two choices (the parent class)

Overflow (`slo_ttft_s`, off by default): with a TTFT SLO given, the router estimates each replica's TTFT
for the request (its backlog now plus the request's own prompt, over the replica's prefill speed). A
request that would meet the SLO on an idle replica but on none now goes to the replica furthest behind
(bounded, `_overflow_order`): in a burst that outruns the fleet, an even spread takes every replica past
the SLO and every request misses; overflow keeps the other replicas inside it for the requests that can
still make it, at the price of a longer wait for those that miss anyway (goodput over tail latency).

Prefix affinity (with engines that cache prefixes, engine/kv_cache_manager.py): a request whose first
prompt blocks this router recently sent to a replica likely finds them in that replica's prefix cache
and prefills only the rest there. The router remembers, per replica, the block digests of the prompts it
sent (`PrefixAffinity`, an LRU of at most the replica's KV capacity in blocks: its cache cannot hold
more). It always counts a sent request's prompt less that likely hit as the backlog it adds there (the
replica's own backlog leaves cached tokens out too). Ranking by it is opt-in (`prefix_affinity`, off
by default: measured, it found more prefixes cached but did not cut SLO misses, README "Prefix caching"):
then the router counts the expected hit off each replica's backlog: the key is the prompt tokens the replica
would prefill before this request's first token, backlog + prompt - hit (without a backlog, -hit: the
hit decides before queue length). A hit counts only when it covers a quarter of the prompt or more
(the chat template's shared opening alone does not), and only on a replica whose queue is at most
`affinity_queue_gap` requests longer than the shortest, so a popular prefix does not pile every
request onto one replica; past that, the other replicas take requests and cache the prefix too. It is
an estimate: the engine evicts cached blocks when it needs room, a restore hides the blocks computed
while morphed from its requests (engine/prefix_hash.py), and other ingress
replicas route too.

Decisions are counted in `morphserve_router_decisions{decision}` (the chosen class, or why the
router fell back), the chosen replica of every `generate` call in `morphserve_router_choices{engine_replica}`.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Hashable

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

# The decisions' names and this process's count of them live apart: Serve pickles this module by value.
from deployments.router_decisions import DECISIONS, FIT_CLASSES, Decision, FitClass, tally  # noqa: F401
from engine.prefix_hash import chain_digests, root

ROUTER_IMPORT_PATH = "deployments.router:PressureAwareRouter"
DECISIONS_METRIC = "morphserve_router_decisions"  # counter, tag `decision`
CHOICES_METRIC = "morphserve_router_choices"  # counter, tag `engine_replica` (Serve reserves `replica`)
STATS_KIND = "morphserve-kv"  # marks stats this router understands
# Ingress -> engine command queue: a Ray actor call plus the replica's event loop, a few ms when idle
# and tens of ms on a saturated 2-core machine; a request sent this long before a cutoff counts as sent
# after it. AppArgs.router_transit_s sets it for the app, with the same default
# (tests/test_router.py holds every default of initialize_state equal to the app's).
TRANSIT_S = 0.05
# Prefix affinity: how many more queued requests than the shortest queue a replica may have and still get
# the credit for a cached prefix. A hit saves a prefill (~0.7 s for 128 tokens in fp32 on one AVX2
# thread), a queued request costs its share of each decode step (a few percent of a step each), and
# every request routed for its hit makes that replica's queue longer than its peers'.
AFFINITY_QUEUE_GAP = 2
# ... and how much of the prompt a hit must cover to count: the chat template's opening (its first block:
# every chat request of a model shares it) is too little to be worth a longer queue (Ray Serve's prefix
# router has such a match-rate threshold too).
AFFINITY_MIN_SHARE = 0.25
# Overflow (`slo_ttft_s`): a request that can meet the SLO nowhere is sent to the most backlogged replica
# only while its expected TTFT there stays under this many SLOs: one that misses anyway should still not
# wait without bound.
OVERFLOW_MAX_SLOS = 5.0


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """One replica's routing stats, as its record_routing_stats() reported them."""
    free_blocks: int  # KV blocks a new request may take: free, net of running and waiting demand
    num_waiting: int  # requests the engine has not admitted yet
    block_size: int  # tokens per KV block
    taken_at: float  # wall clock (time.time) up to which requests that reached the replica are in the figures
    reservation_tokens: int = 0  # output tokens admission reserves per request (engine/demand.py)
    num_quantized: int = 0  # layers it holds quantized now
    morph_blocks: int = 0  # KV blocks its morph added (capacity now less at full precision); a restore takes them
    prefill_tokens: int = 0  # prompt tokens it has yet to prefill (engine/demand.py): what a new request's TTFT waits behind
    prefill_tps: float = 0.0  # prompt tokens it prefills per second (engine/step_stats.py PrefillRate); 0: unknown
    capacity_blocks: int = 0  # its committed KV blocks: the most its prefix cache can hold
    prefix_caching: bool = False  # its engine shares cached prompt prefixes
    # Wall clock the figures hold at: the end of the step they were taken after (None: `taken_at`). The
    # cutoff is that step's *start*, and the step's prefill is already off `prefill_tokens`.
    measured_at: float | None = None

    @property
    def figures_at(self) -> float:
        """When the figures were true: what their age, and the prefill done since, count from."""
        return self.taken_at if self.measured_at is None else max(self.taken_at, self.measured_at)

    def blocks_for(self, prompt_tokens: int, max_tokens: int | None = None) -> int:
        """Blocks admission reserves for a request: prompt + min(max_tokens, reservation)."""
        output = self.reservation_tokens if max_tokens is None else min(max_tokens, self.reservation_tokens)
        return math.ceil(max(1, prompt_tokens + max(0, output)) / self.block_size)

    def backlog_now(self, sent_tokens: int, now: float) -> float:
        """The prompt tokens a request sent now would wait behind: the reported backlog plus the prompts
        sent since the cutoff, less what the replica has prefilled since the figures were measured, at its
        recent speed. Aged from the cutoff instead, the step the figures were taken after counted twice:
        its chunk was already off the backlog, and its duration came off again at the replica's speed.
        That made the replica that had just run a long prefill step (up to a 512-token chunk, ~1 s in fp32
        on one AVX2 thread) look up to a chunk emptier than its peer, so a burst leaned on the busy one."""
        done = self.prefill_tps * max(0.0, now - self.figures_at)
        return max(0.0, self.prefill_tokens + sent_tokens - done)

    def to_stats(self) -> dict[str, Any]:
        return {"kind": STATS_KIND, **dataclasses.asdict(self)}

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> "ReplicaLoad | None":
        if not stats or stats.get("kind") != STATS_KIND:
            return None
        try:
            return cls(int(stats["free_blocks"]), int(stats["num_waiting"]), max(1, int(stats["block_size"])),
                       float(stats["taken_at"]), int(stats.get("reservation_tokens", 0)),
                       int(stats.get("num_quantized", 0)), max(0, int(stats.get("morph_blocks", 0))),
                       max(0, int(stats.get("prefill_tokens", 0))), max(0.0, float(stats.get("prefill_tps", 0.0))),
                       max(0, int(stats.get("capacity_blocks", 0))), bool(stats.get("prefix_caching", False)),
                       None if stats.get("measured_at") is None else float(stats["measured_at"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclasses.dataclass(frozen=True)
class Sent:
    """What the requests this router sent to a replica will need there: KV blocks, prompt tokens."""
    blocks: int = 0
    tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Penalties:
    """What each fit class costs, in queued requests, on top of a replica's queue length."""
    morphed: float = 0.0  # it fits only in the blocks a morph added: it keeps that replica morphed longer
    no_fit: float = 0.0  # it waits there or makes the replica morph

    def __post_init__(self):
        if not 0 <= self.morphed <= self.no_fit:
            raise ValueError(f"router penalties must satisfy 0 <= morphed (router_morphed_penalty, {self.morphed}) <= "
                             f"no_fit (router_no_fit_penalty, {self.no_fit}): "
                             "a request that needs a morph costs at least as much as one that keeps a morph")

    def of(self, fit: FitClass) -> float:
        return {"fits": 0.0, "fits_morphed": self.morphed, "no_fit": self.no_fit}[fit]


def fit_class(load: ReplicaLoad, headroom: int, need: int) -> FitClass:
    """How a request of `need` blocks fits a replica with `headroom` blocks (its stats' free blocks
    less what was sent there since): waiting requests go first (FCFS), so anything waiting is no fit."""
    if load.num_waiting > 0 or headroom < need:
        return "no_fit"
    return "fits" if headroom - load.morph_blocks >= need else "fits_morphed"


def rank_replicas(loads: dict[Hashable, ReplicaLoad | None], queue_lens: dict[Hashable, int | None],
                  prompt_tokens: int, sent: dict[Hashable, Sent], now: float, stale_after_s: float,
                  max_tokens: int | None = None, penalties: Penalties = Penalties(),
                  cached: dict[Hashable, int] | None = None,
                  affinity_queue_gap: int = AFFINITY_QUEUE_GAP,
                  slo_ttft_s: float | None = None) -> tuple[Decision, list[Hashable]]:
    """Pure: (the chosen replica's fit class, every replica cheapest first). Cheapest = the fewest prompt
    tokens prefilled there before this request's first token: while any replica reports a prefill
    backlog, its backlog now (its stats' prompt tokens yet to prefill + the prompts sent there since, less
    what it prefilled since at its reported speed), less the request's expected prefix-cache hit there
    (`cached`, in tokens; counted only where it covers AFFINITY_MIN_SHARE of the prompt and the queue is
    at most `affinity_queue_gap` longer than the shortest); with `slo_ttft_s`, a request that could meet
    it on an idle replica but meets it on none now overflows to the most backlogged (`_overflow_order`,
    decision "overflow"); then cost = queue length + the class's
    penalty, then the better class, then more room at full precision; ("stale", []) when any load is missing or older than `stale_after_s`,
    ("no_queue_len", []) when any queue length is unknown. `sent`: what this router sent to each
    replica after its stats were taken."""
    if not loads or any(load is None or now - load.figures_at > stale_after_s for load in loads.values()):
        return "stale", []
    if any(queue_lens.get(rid) is None for rid in loads):
        return "no_queue_len", []
    nothing = Sent()
    headroom = {rid: load.free_blocks - sent.get(rid, nothing).blocks for rid, load in loads.items()}
    # Prompts sent since a report count only while some replica reports a backlog: else a prompt sent
    # 0.4 s ago, long prefilled, would still weigh until the next report.
    bursting = any(load.prefill_tokens > 0 for load in loads.values())
    backlog = ({rid: load.backlog_now(sent.get(rid, nothing).tokens, now) for rid, load in loads.items()} if bursting
               else dict.fromkeys(loads, 0.0))
    shortest = min(queue_lens[rid] for rid in loads)
    hit = {rid: n if n >= AFFINITY_MIN_SHARE * prompt_tokens and queue_lens[rid] - shortest <= affinity_queue_gap else 0
           for rid, n in ((rid, (cached or {}).get(rid, 0)) for rid in loads)}
    fits = {rid: fit_class(load, headroom[rid], max(1, load.blocks_for(prompt_tokens, max_tokens)))
            for rid, load in loads.items()}
    overflow = _overflow_order(loads, backlog, hit, prompt_tokens, slo_ttft_s) if bursting else None
    if overflow:
        return "overflow", overflow
    order = sorted(loads, key=lambda rid: (backlog[rid] - hit[rid], queue_lens[rid] + penalties.of(fits[rid]),
                                           FIT_CLASSES.index(fits[rid]), -(headroom[rid] - loads[rid].morph_blocks)))
    return fits[order[0]], order


def _overflow_order(loads: dict[Hashable, ReplicaLoad], backlog: dict[Hashable, float], hit: dict[Hashable, int],
                    prompt_tokens: int, slo_ttft_s: float | None) -> list[Hashable] | None:
    """The replicas most backlogged first, for a request that will miss the TTFT SLO wherever it goes
    now (expected TTFT = (backlog now + its prompt less the hit the ranking credits) / prefill speed, over
    the SLO everywhere) though it would meet it on an idle replica; None for any other request, or when
    a replica's speed is unknown. Why: in a burst that outruns the fleet for longer than the SLO,
    spreading evenly brings every replica's backlog past the SLO and then every request misses;
    sending the requests that miss anyway to the replica that is furthest behind keeps the others'
    backlogs at the SLO, so what they drain
    serves requests that can still make it. The price is those requests' TTFT: they wait behind the
    longest backlog, at most OVERFLOW_MAX_SLOS x the SLO (past that they go where they wait least, as
    without it). No margin under the SLO: until every replica is past it this is the even spread, and
    a margin would leave a replica's last part of the SLO unused in a short burst."""
    if slo_ttft_s is None or any(load.prefill_tps <= 0 for load in loads.values()):
        return None
    own = {rid: max(0, prompt_tokens - hit[rid]) / load.prefill_tps for rid, load in loads.items()}
    ttft = {rid: backlog[rid] / loads[rid].prefill_tps + own[rid] for rid in loads}
    if any(t <= slo_ttft_s for t in ttft.values()) or not any(o <= slo_ttft_s for o in own.values()):
        return None
    bounded = [rid for rid in loads if ttft[rid] <= OVERFLOW_MAX_SLOS * slo_ttft_s]
    if not bounded:
        return None
    return sorted(bounded, key=lambda rid: -ttft[rid]) + sorted((rid for rid in loads if rid not in bounded),
                                                                 key=lambda rid: ttft[rid])


class InFlight:
    """What this router sent to each replica, by when (router wall clock), kept for `keep_s`: requests
    sent after a replica's stats' cutoff are not in them yet. `transit_s`: how long a request may take
    from here to the engine's command queue; one sent that long before the cutoff may still have been
    on its way, so it is counted too (counted twice for at most one report if it had arrived, which
    errs towards spreading a burst; missed, it would pile the burst on that replica)."""

    def __init__(self, keep_s: float, transit_s: float = 0.0):
        if transit_s < 0:
            raise ValueError(f"transit_s must be >= 0, got {transit_s}")
        self.keep_s = keep_s
        self.transit_s = transit_s
        self._sent: dict[Hashable, collections.deque[tuple[float, Sent]]] = collections.defaultdict(collections.deque)

    def record(self, replica_id: Hashable, at: float, sent: Sent) -> None:
        queue = self._sent[replica_id]
        queue.append((at, sent))
        while queue and at - queue[0][0] > self.keep_s:  # older than any stats the router would still use
            queue.popleft()

    def since(self, replica_id: Hashable, taken_at: float) -> Sent:
        """The sum sent there after `taken_at` (less `transit_s`): a fresh report resets this to what followed it."""
        after = [sent for at, sent in self._sent.get(replica_id, ()) if at >= taken_at - self.transit_s]
        return Sent(sum(s.blocks for s in after), sum(s.tokens for s in after))


class PrefixAffinity:
    """The block digests of the prompts this router sent to each replica, most recent last, at most
    `keep` per replica (the replica's KV capacity: its prefix cache holds no more)."""

    def __init__(self) -> None:
        self._seen: dict[Hashable, collections.OrderedDict[bytes, None]] = collections.defaultdict(collections.OrderedDict)

    @staticmethod
    def digests(prompt_token_ids, block_size: int, cache_salt: str | None = None) -> list[bytes]:
        """The prompt's full blocks the engine could find cached: all but one holding its last token."""
        return chain_digests(prompt_token_ids, block_size, (len(prompt_token_ids) - 1) // block_size, root(cache_salt))

    def matched_tokens(self, replica_id: Hashable, digests: list[bytes], block_size: int) -> int:
        """Tokens of the longest run of `digests`, from the first, sent to that replica lately."""
        seen, n = self._seen.get(replica_id), 0
        while seen is not None and n < len(digests) and digests[n] in seen:
            n += 1
        return n * block_size

    def record(self, replica_id: Hashable, digests: list[bytes], keep: int) -> None:
        seen = self._seen[replica_id]
        for d in digests:
            seen[d] = None
            seen.move_to_end(d)
        while len(seen) > max(0, keep):
            seen.popitem(last=False)


class PressureAwareRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, stale_after_s: float = 2.0, morphed_penalty: float = 0.0, no_fit_penalty: float = 0.0,
                         transit_s: float = TRANSIT_S, prefix_affinity: bool = False,
                         affinity_queue_gap: int = AFFINITY_QUEUE_GAP, slo_ttft_s: float | None = None,
                         **kwargs: Any) -> None:
        """Keyword arguments come from the deployment's `request_router_config.request_router_kwargs`."""
        super().initialize_state(**kwargs)
        self.stale_after_s = stale_after_s
        self.penalties = Penalties(morphed=morphed_penalty, no_fit=no_fit_penalty)
        # A report's cutoff is a step before its figures (which staleness counts from): keep enough.
        self._in_flight = InFlight(keep_s=3 * stale_after_s, transit_s=transit_s)
        self.prefix_affinity, self.affinity_queue_gap = prefix_affinity, affinity_queue_gap
        if slo_ttft_s is not None and not slo_ttft_s > 0:
            raise ValueError(f"slo_ttft_s must be > 0 or None, got {slo_ttft_s}")
        self.slo_ttft_s = slo_ttft_s
        self._affinity = PrefixAffinity()
        self._decisions = self._choices = None  # the counters, made on first use inside the ingress replica

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        request = _generate_request(pending_request)
        if request is None:
            self._count("other_call")
            return await super().choose_replicas(candidate_replicas, pending_request)
        now = time.time()
        loads = {r.replica_id: ReplicaLoad.from_stats(r.routing_stats) for r in candidate_replicas}
        queue_lens = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) for r in candidate_replicas}
        sent = {rid: self._in_flight.since(rid, load.taken_at) for rid, load in loads.items() if load is not None}
        digests = _PromptDigests(request)  # one chain per block size, not one per replica
        cached = ({rid: self._expected_hit(rid, load, digests) for rid, load in loads.items() if load is not None}
                  if self.prefix_affinity else {})  # the ranking's credit for a hit is the opt-in part
        decision, order = rank_replicas(loads, queue_lens, len(request.prompt_token_ids), sent, now,
                                        self.stale_after_s, request.max_tokens, self.penalties, cached,
                                        self.affinity_queue_gap, self.slo_ttft_s)
        self._count(decision)
        if not order:  # stale stats or an unknown queue length: Serve's default (its probes refill the cache)
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        request = _generate_request(pending_request)
        if request is None:
            return
        self._count_choice(replica_id)
        stats = self._replicas.get(replica_id)
        load = ReplicaLoad.from_stats(stats.routing_stats) if stats is not None else None
        if load is None:
            return
        prompt = len(request.prompt_token_ids)
        digests = _PromptDigests(request)
        # What it will prefill there is its prompt less the likely hit, with affinity on or off: the
        # replica's reported backlog leaves cached tokens out, so the prompts sent since must too, else
        # the replica whose report is older looks busier by the cached share of what it was sent.
        hit = self._expected_hit(replica_id, load, digests)  # before recording: what it finds there now
        self._in_flight.record(replica_id, time.time(), Sent(load.blocks_for(prompt, request.max_tokens), prompt - hit))
        if load.prefix_caching:
            self._affinity.record(replica_id, digests.of(load.block_size), keep=load.capacity_blocks)

    def _expected_hit(self, replica_id: Any, load: ReplicaLoad, digests: "_PromptDigests") -> int:
        """Prompt tokens the request likely finds in that replica's prefix cache (0 where it does not cache)."""
        if not load.prefix_caching:
            return 0
        return self._affinity.matched_tokens(replica_id, digests.of(load.block_size), load.block_size)

    def _count(self, decision: Decision) -> None:
        tally(decision)
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


class _PromptDigests:
    """A request's prompt blocks as a replica's prefix cache keys them (its cache_salt included), computed
    on first use per block size."""

    def __init__(self, request: Any):
        self.request, self._by_size = request, {}

    def of(self, block_size: int) -> list[bytes]:
        if block_size not in self._by_size:
            self._by_size[block_size] = PrefixAffinity.digests(self.request.prompt_token_ids, block_size,
                                                               getattr(self.request, "cache_salt", None))
        return self._by_size[block_size]


def _generate_request(pending_request: Any) -> Any:
    """The GenerateRequest of a `generate` call (what KV admission is about), else None."""
    if pending_request is None or getattr(pending_request.metadata, "call_method", None) != "generate":
        return None
    request = pending_request.args[0] if pending_request.args else None
    return request if hasattr(request, "prompt_token_ids") else None
