"""The soak's accounting (ops/soak_record.py): which failures are allowed, cycles, memory, integrity."""
from ops.soak_record import (RequestRecord, Sample, classify_requests, count_morph_cycles, integrity_totals,
                             memory_by_replica, rss_series, verdict)


def sample(t, pid=1, rss=100, q=0, checks=0, failures=0, idle=False, anon=None):
    return Sample(t, pid, rss, q, checks, failures, True, idle, anon)


def test_only_requests_in_flight_at_the_replica_kill_may_fail():
    records = [RequestRecord(0, 1, 200), RequestRecord(4, 6, 0), RequestRecord(7, 8, 500),
               RequestRecord(8, 9, 503), RequestRecord(9, 10, 200)]
    counts = classify_requests(records, replica_kills=[5.0])
    assert counts == {"sent": 5, "ok": 2, "refused_503": 1, "failed": 2, "failed_in_flight_at_replica_kill": 1,
                      "failed_unexplained": 1}


def test_a_morph_cycle_is_down_then_back_to_full_precision():
    qs = [0, 0, 4, 8, 0, 0, 2, 0, 6]  # two full cycles; the last descent has not come back
    assert count_morph_cycles([sample(i, q=q) for i, q in enumerate(qs)]) == 2


def test_memory_compares_each_replicas_last_idle_sample_with_its_first():
    samples = [sample(0, rss=100), sample(1, rss=200, idle=True), sample(2, rss=260), sample(3, rss=205, idle=True),
               sample(4, pid=2, rss=90), sample(5, pid=2, rss=150, idle=True), sample(6, pid=2, rss=170, idle=True)]
    first, second = memory_by_replica(samples, tolerance=0.05)
    assert (first["rss_first_idle"], first["rss_last_idle"], first["rss_peak"]) == (200, 205, 260)
    assert first["within_tolerance"] and not second["within_tolerance"]
    assert second["growth_after_first_idle"] == (170 - 150) / 150
    shrunk, = memory_by_replica([sample(0, rss=200, idle=True), sample(1, rss=150, idle=True)], tolerance=0.05)
    assert shrunk["within_tolerance"]  # ending below the first plateau is no growth


def test_growth_that_is_all_mapped_file_pages_is_not_a_leak_but_anonymous_growth_is():
    file_pages = [sample(0, rss=200, anon=150, idle=True), sample(1, rss=230, anon=152, idle=True)]
    row, = memory_by_replica(file_pages, tolerance=0.05)
    assert not row["within_tolerance"] and row["anon_within_tolerance"] and row["growth_is_mapped_file_pages"]
    leak = [sample(0, rss=200, anon=150, idle=True), sample(1, rss=230, anon=180, idle=True)]
    row, = memory_by_replica(leak, tolerance=0.05)
    assert not row["anon_within_tolerance"] and not row["growth_is_mapped_file_pages"]
    requests = classify_requests([RequestRecord(0, 1, 200)], [])
    integrity = {"checks": 1, "failures": 0}
    assert verdict(requests, 3, 2, integrity, memory_by_replica(file_pages, 0.05))["rss_end_within_tolerance"]
    assert not verdict(requests, 3, 2, integrity, memory_by_replica(leak, 0.05))["rss_end_within_tolerance"]


def test_rss_series_keeps_one_sample_per_interval():
    series = rss_series([sample(t / 2, rss=100 + t, anon=50) for t in range(50)], every_s=10.0)
    assert [row[0] for row in series] == [0.0, 10.0, 20.0]
    assert series[1] == [10.0, 1, 120, 50]


def test_integrity_sums_the_last_counts_of_every_replica_and_the_verdict_needs_all():
    samples = [sample(0, checks=5), sample(1, checks=9, failures=0), sample(2, pid=2, checks=4, failures=1)]
    integrity = integrity_totals(samples)
    assert integrity == {"checks": 13, "failures": 1}
    requests = classify_requests([RequestRecord(0, 1, 200)], [])
    memory = [{"within_tolerance": True}]
    assert verdict(requests, 3, 2, {"checks": 13, "failures": 0}, memory) == {
        "no_unexplained_failures": True, "enough_morph_cycles": True, "integrity_held": True,
        "rss_end_within_tolerance": True}
    assert not verdict(requests, 1, 2, integrity, memory)["integrity_held"]
