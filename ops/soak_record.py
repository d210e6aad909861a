"""What a soak run (ops/soak.py) records, and the verdict drawn from it. Pure: no clocks, no I/O.

Requests are (start, end, status). A request may fail only if it was in flight when the engine
replica was killed; 503s (with Retry-After) while the replacement loads are refusals, counted apart.
Morph cycles are read from the sampled number of quantized layers: a cycle is a rise above 0 and
the return to 0. Memory is the replica's resident set: per replica process, its first idle plateau
(RSS at the end of its first idle phase), its peak and its last idle sample; the same for its
anonymous part (heap, tensors), since file-backed pages of the mapped host store are bounded by the
store's size and are not a leak.
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
    rss_anon_bytes: int | None = None  # the anonymous part of rss_bytes (the rest: mapped file pages)


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
            if idle[0].rss_anon_bytes and idle[-1].rss_anon_bytes:  # both sampled (0 would mean unread)
                a0, a1 = idle[0].rss_anon_bytes, idle[-1].rss_anon_bytes
                anon_ok = (a1 - a0) / a0 <= tolerance
                row.update(anon_first_idle=a0, anon_last_idle=a1, anon_growth_after_first_idle=(a1 - a0) / a0,
                           anon_within_tolerance=anon_ok,
                           # total growth that is all file-backed pages: the mapped store, not a leak
                           growth_is_mapped_file_pages=not row["within_tolerance"] and anon_ok)
        out.append(row)
    return out


def rss_series(samples: list[Sample], every_s: float) -> list[list]:
    """[seconds since the first sample, pid, rss, anonymous rss] at most one per `every_s`: the
    published run's memory over time, to tell a plateau from a slope."""
    out: list[list] = []
    for s in samples:
        t = round(s.time - samples[0].time, 1)
        if not out or t - out[-1][0] >= every_s:
            out.append([t, s.pid, s.rss_bytes, s.rss_anon_bytes])
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
    measured = [m for m in memory if "within_tolerance" in m]  # replicas with two idle plateaus
    return {"no_unexplained_failures": requests["failed_unexplained"] == 0,
            "enough_morph_cycles": cycles >= min_cycles,
            "integrity_held": integrity["failures"] == 0 and integrity["checks"] > 0,
            "rss_end_within_tolerance": bool(measured) and all(
                m["within_tolerance"] or m.get("growth_is_mapped_file_pages", False) for m in measured)}
