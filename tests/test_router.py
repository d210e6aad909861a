"""The pressure-aware router's ranking (pure) and its stats round trip; the router itself runs in the
2-replica fleet test (tests/test_fleet_serve.py)."""
from __future__ import annotations

from deployments.router import ReplicaLoad, rank_replicas

NOW = 1000.0


def load(free: int, waiting: int = 0, age: float = 0.1, quantized: int = 0) -> ReplicaLoad:
    return ReplicaLoad(free_blocks=free, num_waiting=waiting, block_size=16, taken_at=NOW - age,
                       num_quantized=quantized)


def test_requests_go_to_the_replicas_whose_kv_admits_them_now():
    decision, ranks = rank_replicas({"full": load(1), "roomy": load(40), "queued": load(60, waiting=2)},
                                    prompt_tokens=100, sent_blocks={}, now=NOW, stale_after_s=2.0)
    # 100 tokens need 7 blocks: only "roomy" admits; "queued" has room but requests wait ahead (FCFS).
    assert decision == "admits" and ranks == [["roomy"], ["queued"], ["full"]]


def test_those_that_admit_with_room_to_spare_share_one_rank_for_serve_to_break_the_tie_by_queue_length():
    # 64 tokens need 4 blocks: 20 and 9 free blocks both hold this request and one more like it.
    decision, ranks = rank_replicas({"a": load(20), "b": load(9), "c": load(2)}, prompt_tokens=64,
                                    sent_blocks={}, now=NOW, stale_after_s=2.0)
    assert decision == "admits" and ranks == [["a", "b"], ["c"]]


def test_a_replica_the_request_would_fill_comes_after_those_with_room_to_spare():
    # 7 free blocks take this 4-block request but not one more: it would be pressed to morph.
    loads = {"tight": load(7), "roomy": load(30), "full": load(2)}
    assert rank_replicas(loads, 64, {}, NOW, 2.0) == ("admits", [["roomy"], ["tight"], ["full"]])
    # With no spare asked for, both fit alike and Serve's queue length decides.
    assert rank_replicas(loads, 64, {}, NOW, 2.0, spare_requests=0) == ("admits", [["tight", "roomy"], ["full"]])


def test_a_morphed_replica_gets_requests_only_after_every_unmorphed_one_that_admits():
    # "morphed" has the most room (its quantized layers freed KV) but takes less so it can restore.
    loads = {"morphed": load(60, quantized=6), "tight": load(7), "roomy": load(12), "full": load(1)}
    decision, ranks = rank_replicas(loads, prompt_tokens=64, sent_blocks={}, now=NOW, stale_after_s=2.0)
    assert decision == "admits" and ranks == [["roomy"], ["tight"], ["morphed"], ["full"]]
    # When only the morphed one admits, it still comes before those that cannot.
    loads = {"morphed": load(60, quantized=6), "full": load(1)}
    assert rank_replicas(loads, 64, {}, NOW, 2.0) == ("admits", [["morphed"], ["full"]])


def test_blocks_already_sent_since_the_stats_count_against_a_replica():
    decision, ranks = rank_replicas({"a": load(20), "b": load(10)}, prompt_tokens=64, sent_blocks={"a": 18},
                                    now=NOW, stale_after_s=2.0)
    assert decision == "admits" and ranks == [["b"], ["a"]]


def test_when_none_admits_the_most_headroom_goes_first():
    decision, ranks = rank_replicas({"a": load(3, waiting=1), "b": load(5, waiting=4)}, prompt_tokens=200,
                                    sent_blocks={}, now=NOW, stale_after_s=2.0)
    assert decision == "kv_full" and ranks == [["b"], ["a"]]


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
