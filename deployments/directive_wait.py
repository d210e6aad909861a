"""DirectiveWait: how long each morph-loop round waited for its directive, as bucket counts.

With the fleet controller that is the report's round trip to the controller actor (or the deadline,
when it did not answer and the local policy decided); without it, the local policy's decision. A round
waits for it before it can hand the engine a target or a grant, so on a loaded host this is how late a
replica's reaction comes because of the fleet. Kept as cumulative counts per bucket (like a Prometheus
histogram) so that a reader can subtract two readings and get the wait of the rounds in between
(`since`), whichever moment it first polled: the benchmark does that for the replay of each run.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping

# Upper bounds of the buckets, in seconds; the last bucket (above 1 s) is open. From a local decision
# (~10 us) to a controller past its default deadline (0.5 s).
BOUNDS_S: tuple[float, ...] = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclasses.dataclass
class DirectiveWait:
    counts: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(BOUNDS_S) + 1))
    sum_s: float = 0.0
    max_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BOUNDS_S, seconds)] += 1
        self.sum_s += seconds
        self.max_s = max(self.max_s, seconds)

    def as_dict(self) -> dict:
        """The admin status' form (also what `since` and `summary` read)."""
        return {"bounds_s": list(BOUNDS_S), "counts": list(self.counts), "sum_s": round(self.sum_s, 6),
                "max_s": round(self.max_s, 6)}


def since(before: Mapping | None, after: Mapping) -> dict:
    """The waits observed between two readings of one replica (`as_dict`); `before` None: all of them.
    The maximum cannot be subtracted; the one of `after` is kept (an upper bound)."""
    if before is None:
        return dict(after)
    if list(before["bounds_s"]) != list(after["bounds_s"]):
        raise ValueError("the two readings use different buckets")
    counts = [a - b for a, b in zip(after["counts"], before["counts"])]
    if any(c < 0 for c in counts):
        raise ValueError("the later reading has fewer rounds than the earlier one (was the replica restarted?)")
    return {**after, "counts": counts, "sum_s": after["sum_s"] - before["sum_s"]}


def merged(readings: list[Mapping]) -> dict | None:
    """Several replicas' waits as one (the same buckets); None for none."""
    if not readings:
        return None
    counts = [sum(r["counts"][i] for r in readings) for i in range(len(readings[0]["counts"]))]
    return {"bounds_s": list(readings[0]["bounds_s"]), "counts": counts,
            "sum_s": sum(r["sum_s"] for r in readings), "max_s": max(r["max_s"] for r in readings)}


def summary(reading: Mapping | None) -> dict[str, float] | None:
    """rounds, mean, P50 and P95 (each the upper bound of the bucket holding that rank; the open bucket
    reads as the maximum), and the share of rounds that waited over 0.1 s; None without rounds."""
    if reading is None or sum(reading["counts"]) == 0:
        return None
    counts, bounds = reading["counts"], [*reading["bounds_s"], reading["max_s"]]
    rounds = sum(counts)

    def rank(q: float) -> float:
        seen = 0
        for i, c in enumerate(counts):
            seen += c
            if seen >= q * rounds:
                return float(bounds[i])
        return float(bounds[-1])

    over = sum(c for c, b in zip(counts, [*reading["bounds_s"], float("inf")]) if b > 0.1)
    return {"rounds": float(rounds), "mean_s": reading["sum_s"] / rounds, "p50_s": rank(0.5), "p95_s": rank(0.95),
            "over_100ms_share": over / rounds}
