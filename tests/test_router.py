"""The pressure-aware router's ranking (pure) and its stats round trip; the router itself runs in the
2-replica fleet test (tests/test_fleet_serve.py)."""
from __future__ import annotations

import random

from deployments.router import InFlight, ReplicaLoad, rank_replicas, two_choices

NOW = 1000.0


def load(free: int, waiting: int = 0, age: float = 0.1, quantized: int = 0) -> ReplicaLoad:
    return ReplicaLoad(free_blocks=free, num_waiting=waiting, block_size=16, taken_at=NOW - age,
                       num_quantized=quantized)


def test_requests_go_to_the_replicas_whose_kv_admits_them_now():
    decision, ranks = rank_replicas({"full": load(1), "roomy": load(40), "queued": load(60, waiting=2)},
                                    prompt_tokens=100, sent_blocks={}, now=NOW, stale_after_s=2.0)
    # 100 tokens need 7 blocks: only "roomy" admits; "queued" has room but requests wait ahead (FCFS).
    assert decision == "admits" and ranks == [["roomy"], ["queued", "full"]]


def test_all_that_admit_share_the_first_rank_for_serve_to_choose_by_queue_length():
    # 64 tokens need 4 blocks: 20 and 5 free blocks both admit it; how much room is left does not
    # rank them (it changes only at the next report): Serve's queue length does.
    decision, ranks = rank_replicas({"a": load(20), "b": load(5), "c": load(2)}, prompt_tokens=64,
                                    sent_blocks={}, now=NOW, stale_after_s=2.0)
    assert decision == "admits" and ranks == [["a", "b"], ["c"]]  # "c" only if both queues are full


def test_an_unmorphed_replica_is_preferred_only_as_the_tie_break_order():
    # "morphed" has the most room (its quantized layers freed KV) but is listed after the unmorphed
    # ones that admit, so on equal queues Serve sends it less and it can restore; it is still in rank 1.
    loads = {"morphed": load(60, quantized=6), "tight": load(7), "roomy": load(12), "full": load(1)}
    decision, ranks = rank_replicas(loads, prompt_tokens=64, sent_blocks={}, now=NOW, stale_after_s=2.0)
    assert decision == "admits" and ranks == [["roomy", "tight", "morphed"], ["full"]]
    assert serve_picks(ranks, {"roomy": 3, "tight": 3, "morphed": 1, "full": 0}) == "morphed"  # queue first


def test_blocks_already_sent_since_the_stats_count_against_a_replica():
    decision, ranks = rank_replicas({"a": load(20), "b": load(10)}, prompt_tokens=64, sent_blocks={"a": 18},
                                    now=NOW, stale_after_s=2.0)
    assert decision == "admits" and ranks == [["b"], ["a"]]
    # A fresh report (taken after those sends) includes them: nothing is subtracted any more.
    assert rank_replicas({"a": load(20), "b": load(10)}, 64, {}, NOW, 2.0) == ("admits", [["a", "b"]])


def test_when_none_admits_the_shortest_queue_decides_and_headroom_only_breaks_ties():
    # A morphed replica has the most headroom; ranking by it would draw the load there and keep it morphed.
    decision, ranks = rank_replicas({"a": load(3, waiting=1), "b": load(5, waiting=4, quantized=8)}, prompt_tokens=200,
                                    sent_blocks={}, now=NOW, stale_after_s=2.0)
    assert decision == "kv_full" and ranks == [["b", "a"]]
    assert serve_picks(ranks, {"a": 2, "b": 6}) == "a" and serve_picks(ranks, {"a": 3, "b": 3}) == "b"


def test_stale_or_missing_stats_fall_back_to_serves_default():
    assert rank_replicas({"a": load(20), "b": load(20, age=5.0)}, 10, {}, NOW, 2.0) == ("stale", [])
    assert rank_replicas({"a": load(20), "b": None}, 10, {}, NOW, 2.0) == ("stale", [])
    assert rank_replicas({}, 10, {}, NOW, 2.0) == ("stale", [])


def test_stats_round_trip_and_foreign_stats_are_ignored():
    original = load(12, waiting=3, quantized=4)
    assert ReplicaLoad.from_stats(original.to_stats()) == original
    assert ReplicaLoad.from_stats({}) is None and ReplicaLoad.from_stats({"kind": "other", "x": 1}) is None
    assert ReplicaLoad.from_stats({**original.to_stats(), "free_blocks": "many"}) is None


def test_a_request_needs_its_prompt_and_the_output_reservation_capped_by_max_tokens():
    roomy = ReplicaLoad(free_blocks=8, num_waiting=0, block_size=16, taken_at=NOW, reservation_tokens=64)
    assert roomy.blocks_for(100) == 11 and roomy.blocks_for(100, max_tokens=12) == 7
    # 100 prompt tokens + 64 reserved = 11 blocks do not fit 8; with max_tokens 12 (7 blocks) they do.
    assert rank_replicas({"r": roomy}, 100, {}, NOW, 2.0)[0] == "kv_full"
    assert rank_replicas({"r": roomy}, 100, {}, NOW, 2.0, max_tokens=12) == ("admits", [["r"]])
    assert ReplicaLoad.from_stats(roomy.to_stats()) == roomy


def serve_picks(ranks: list[list[str]], queue: dict[str, int]) -> str:
    """What Serve does with the ranks (request_router.py): the first rank's shortest queue, the first
    listed on a tie (a fake of the layer above, for these unit tests)."""
    return min(ranks[0], key=lambda rid: queue[rid])


def test_a_burst_between_two_reports_spreads_evenly_over_two_equal_replicas():
    loads = {"a": load(40), "b": load(40)}
    in_flight, queue, sent_to = InFlight(keep_s=4.0), {"a": 0, "b": 0}, {"a": 0, "b": 0}
    for i in range(8):  # 8 requests of 4 blocks, all before the next stats
        sent = {rid: in_flight.since(rid, l.taken_at) for rid, l in loads.items()}
        decision, ranks = rank_replicas(loads, 64, sent, NOW + 0.01 * i, 2.0)
        assert decision == "admits"
        chosen = serve_picks(ranks, queue)
        queue[chosen] += 1
        sent_to[chosen] += 1
        in_flight.record(chosen, NOW + 0.01 * i, 4)
    assert sent_to == {"a": 4, "b": 4}


def test_a_replica_that_cannot_admit_gets_nothing_while_another_can_even_with_a_longer_queue():
    loads = {"busy": load(40), "full": load(3)}
    decision, ranks = rank_replicas(loads, 64, {}, NOW, 2.0)
    assert decision == "admits" and serve_picks(ranks, {"busy": 6, "full": 0}) == "busy"
    # ... and once what was sent there used up its room, neither admits: the queue decides.
    decision, ranks = rank_replicas(loads, 64, {"busy": 40}, NOW, 2.0)
    assert decision == "kv_full" and ranks == [["full", "busy"]]


def test_in_flight_blocks_count_until_a_report_taken_after_them_and_are_kept_only_so_long():
    in_flight = InFlight(keep_s=4.0)
    in_flight.record("a", NOW, 4)
    in_flight.record("a", NOW + 1.0, 6)
    assert in_flight.since("a", NOW - 0.5) == 10  # stats older than both sends: both count
    assert in_flight.since("a", NOW + 0.5) == 6  # a fresh report includes the first
    assert in_flight.since("a", NOW + 2.0) == 0 and in_flight.since("b", 0.0) == 0
    in_flight.record("a", NOW + 10.0, 1)  # the first two are dropped: no stats that old are used
    assert in_flight.since("a", 0.0) == 1


def test_power_of_two_choices_among_more_replicas_that_admit():
    rank = ["r0", "r1", "r2", "r3", "r4"]
    for seed in range(20):
        first, rest = two_choices(rank, random.Random(seed))
        assert len(first) == 2 and sorted(first + rest) == rank
        assert first == sorted(first, key=rank.index)  # the tie-break order is kept
    assert two_choices(["a", "b"], random.Random(0)) == [["a", "b"]]
