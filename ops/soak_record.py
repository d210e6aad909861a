"""What a soak run (ops/soak.py) records, and the verdict drawn from it. Pure: no clocks, no I/O.

Requests are (start, end, status). A request may fail only if it was in flight when the engine
replica was killed; 503s (with Retry-After) while the replacement loads are refusals, counted apart.
Morph cycles are read from the sampled number of quantized layers: a cycle is a rise above 0 and
the return to 0. Memory is the replica's resident set: per replica process, its first idle plateau
(RSS at the end of its first idle phase), its peak and its last idle sample.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    start: float
    end: float
    status: int  # HTTP status; 0 = no answer (connection reset, timeout)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One look at the replica through GET /admin/morph."""
    time: float
    pid: int
    rss_bytes: int
    num_quantized: int
    integrity_checks: int
    integrity_failures: int
    controller_reachable: bool
    idle: bool  # taken at the end of an idle phase (no traffic for a while)


def classify_requests(records: list[RequestRecord], replica_kills: list[float]) -> dict[str, int]:
    ok = sum(1 for r in records if r.status == 200)
    refused = sum(1 for r in records if r.status == 503)
    failed = [r for r in records if r.status not in (200, 503)]
    at_kill = [r for r in failed if any(r.start <= t <= r.end for t in replica_kills)]
    return {"sent": len(records), "ok": ok, "refused_503": refused, "failed": len(failed),
            "failed_in_flight_at_replica_kill": len(at_kill), "failed_unexplained": len(failed) - len(at_kill)}


def count_morph_cycles(samples: list[Sample]) -> int:
    cycles, low = 0, False
    for s in samples:
        if s.num_quantized > 0:
            low = True
        elif low:
            cycles, low = cycles + 1, False
    return cycles


def memory_by_replica(samples: list[Sample], tolerance: float) -> list[dict[str, Any]]:
    """Per replica process: RSS at its first and last idle samples, its peak, and whether the end
    grew by at most `tolerance` (a fraction) over the first idle plateau (ending lower is fine: the
    first plateau may still hold a burst's heap that a later idle trim returned)."""
    out = []
    for pid in dict.fromkeys(s.pid for s in samples):
        mine = [s for s in samples if s.pid == pid]
        idle = [s for s in mine if s.idle]
        row: dict[str, Any] = {"pid": pid, "rss_start": mine[0].rss_bytes, "rss_peak": max(s.rss_bytes for s in mine),
                               "rss_end": mine[-1].rss_bytes, "idle_samples": len(idle)}
        if len(idle) >= 2:
            first, last = idle[0].rss_bytes, idle[-1].rss_bytes
            row.update(rss_first_idle=first, rss_last_idle=last, growth_after_first_idle=(last - first) / first,
                       within_tolerance=(last - first) / first <= tolerance)
        out.append(row)
    return out


def integrity_totals(samples: list[Sample]) -> dict[str, int]:
    """Checks and failures summed over replica processes (each counts from 0)."""
    last: dict[int, Sample] = {}
    for s in samples:
        last[s.pid] = s
    return {"checks": sum(s.integrity_checks for s in last.values()),
            "failures": sum(s.integrity_failures for s in last.values())}


def verdict(requests: dict[str, int], cycles: int, min_cycles: int, integrity: dict[str, int],
            memory: list[dict[str, Any]]) -> dict[str, bool]:
    final = memory[-1] if memory else {}
    return {"no_unexplained_failures": requests["failed_unexplained"] == 0,
            "enough_morph_cycles": cycles >= min_cycles,
            "integrity_held": integrity["failures"] == 0 and integrity["checks"] > 0,
            "rss_end_within_tolerance": bool(final.get("within_tolerance", False))}
