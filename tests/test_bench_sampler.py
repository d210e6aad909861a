"""The benchmark's admin sampler (ops/bench/run_one.py): it reads counts each engine replica keeps
and sums them over the replicas, whichever replica Serve routed each poll to."""
import itertools
import json

import pytest

from ops.bench import run_one


def _status(replica_id: str, calls: int, waits: dict) -> str:
    return json.dumps({"replica_id": replica_id, "queue": {"generate_calls": calls}, "waiting_rounds": waits,
                       "quantized_history": [], "morph_state": {"num_quantized": 0}})


def test_each_replicas_latest_counts_are_kept_and_summed(monkeypatch):
    answers = itertools.cycle([_status("a", 3, {"compute": 2}), _status("b", 5, {"memory": 1}),
                               _status("a", 4, {"compute": 2, "memory": 3})])  # a's later answer replaces its first
    monkeypatch.setattr(run_one, "http_get", lambda url, headers, timeout_s: (200, next(answers)))
    sampler = run_one._AdminSampler("http://127.0.0.1:1/admin/morph", "token", 0.25, replicas=2)
    for _ in range(3):
        sampler._poll(0.0)
    totals = sampler.totals()
    assert totals.generate_calls == (4, 5)  # by replica id
    assert dict(totals.waiting_rounds) == {"compute": 2, "memory": 4}
    assert sampler.totals({"a": 1, "b": 2}).generate_calls == (3, 3)  # the replay's calls: warm-ups taken off


def test_a_replica_without_the_counts_adds_nothing(monkeypatch):
    body = json.dumps({"replica_id": "old", "queue": {}, "morph_state": {"num_quantized": 0}})
    monkeypatch.setattr(run_one, "http_get", lambda url, headers, timeout_s: (200, body))
    sampler = run_one._AdminSampler("http://127.0.0.1:1/admin/morph", "token", 0.25)
    sampler._poll(0.0)
    assert sampler.totals() == run_one.ReplicaTotals()


def test_each_replicas_directive_waits_count_from_its_first_reading_in_the_replay(monkeypatch):
    from deployments.directive_wait import DirectiveWait

    waits = {rid: DirectiveWait() for rid in "ab"}
    waits["a"].observe(0.3)  # before the replay's first poll: not the replay's

    def answer(url, headers, timeout_s):
        rid = next(turns)
        waits[rid].observe(0.002 if rid == "a" else 0.04)
        return 200, json.dumps({"replica_id": rid, "queue": {}, "morph_state": {"num_quantized": 0},
                                "directive_wait": waits[rid].as_dict()})

    turns = iter("abab")
    monkeypatch.setattr(run_one, "http_get", answer)
    sampler = run_one._AdminSampler("http://127.0.0.1:1/admin/morph", "token", 0.25, replicas=2)
    for _ in range(4):
        sampler._poll(0.0)
    merged = sampler.totals().directive_wait
    assert sum(merged["counts"]) == 2  # one round each between its two readings
    assert merged["sum_s"] == pytest.approx(0.042)
    restarted = DirectiveWait()  # a replica restarted during the replay: its counts start again
    sampler.directive_waits["a"] = (sampler.directive_waits["a"][1], restarted.as_dict())
    assert sum(sampler.totals().directive_wait["counts"]) == 1  # b's round only; the run is not failed


class FakeFleet:
    """Replicas that come up one by one (after so many admin polls); Serve's router sends each call to
    one of the replicas up, in turn."""

    def __init__(self, up_after_polls: dict[str, int]):
        self.up_after, self.calls, self.polls, self.turn = up_after_polls, {}, 0, itertools.count()

    def _pick(self) -> str:
        up = [rid for rid, after in self.up_after.items() if self.polls >= after]
        return up[next(self.turn) % len(up)]

    def post(self, url, body, headers=None, timeout_s=300):  # a warm-up request
        rid = self._pick()
        self.calls[rid] = self.calls.get(rid, 0) + 1
        return 200, "{}"

    def get(self, url, headers=None, timeout_s=5.0):  # GET /admin/morph
        self.polls += 1
        rid = self._pick()
        return 200, json.dumps({"replica_id": rid, "queue": {"generate_calls": self.calls.get(rid, 0)}})


def _fleet(monkeypatch, up_after_polls: dict[str, int]) -> FakeFleet:
    fleet = FakeFleet(up_after_polls)
    monkeypatch.setattr(run_one, "http_post_json", fleet.post)
    monkeypatch.setattr(run_one, "http_get", fleet.get)
    return fleet


def test_the_replay_waits_until_every_replica_is_up_and_warmed(monkeypatch):
    fleet = _fleet(monkeypatch, {"a": 0, "b": 6})  # b is still starting during the first round
    warm_ups = run_one._warm_up_replicas("http://127.0.0.1:1", "token", "m", replicas=2, deadline_s=60)
    assert fleet.calls["a"] > 0 and fleet.calls["b"] > 0
    assert warm_ups == fleet.calls  # what each served before the replay, to take off its count


def test_a_replica_that_never_comes_up_fails_the_start_with_what_was_seen(monkeypatch):
    _fleet(monkeypatch, {"a": 0, "b": 10**9})
    with pytest.raises(run_one.ServerStartError, match="2 engine replicas not all up.*'a'"):
        run_one._warm_up_replicas("http://127.0.0.1:1", "token", "m", replicas=2, deadline_s=0)
