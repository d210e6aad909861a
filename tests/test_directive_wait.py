"""DirectiveWait (deployments/directive_wait.py): bucket counts a reader can subtract, merge and summarise."""
import pytest

from deployments.directive_wait import BOUNDS_S, DirectiveWait, merged, since, summary


def _waits(*seconds: float) -> DirectiveWait:
    w = DirectiveWait()
    for s in seconds:
        w.observe(s)
    return w


def test_each_wait_lands_in_the_bucket_of_its_upper_bound():
    w = _waits(0.00001, 0.001, 0.03, 0.3, 7.0)
    counts = dict(zip([*BOUNDS_S, "open"], w.as_dict()["counts"]))
    assert counts[0.001] == 2  # a bound is inclusive, as Prometheus' "le"
    assert counts[0.05] == 1 and counts[0.5] == 1 and counts["open"] == 1
    assert w.as_dict()["max_s"] == 7.0 and w.as_dict()["sum_s"] == pytest.approx(7.33101)


def test_two_readings_subtract_to_the_rounds_between_them():
    w = _waits(0.002, 0.002)
    before = w.as_dict()
    for s in (0.2, 0.2, 0.002):
        w.observe(s)
    between = since(before, w.as_dict())
    assert sum(between["counts"]) == 3 and between["sum_s"] == pytest.approx(0.402)
    assert since(None, before) == before  # no earlier reading: everything so far
    with pytest.raises(ValueError, match="fewer rounds"):
        since(w.as_dict(), before)  # a restarted replica's counts start again


def test_the_summary_reads_ranks_from_the_buckets_and_the_open_bucket_as_the_maximum():
    fast = _waits(*[0.0001] * 18, 0.3, 2.5)  # 18 local decisions, a slow round trip, one past the deadline
    s = summary(fast.as_dict())
    assert s["rounds"] == 20 and s["p50_s"] == 0.001
    assert s["p95_s"] == 0.5  # the 19th of 20 rounds lies in (0.25, 0.5]
    assert s["over_100ms_share"] == pytest.approx(0.1)
    assert summary(merged([fast.as_dict(), _waits(3.0).as_dict()]))["p95_s"] == 3.0  # the open bucket: the max
    assert summary(DirectiveWait().as_dict()) is None and merged([]) is None
