"""The pressure-aware router's decisions: their names, and this process's count of them.

A module of its own, apart from deployments/router.py, because Ray Serve ships a request router *by
value*: it cloudpickles the router's class with its whole module registered pickle-by-value
(RequestRouterConfig), so in the ingress the router's functions see a copy of that module's globals,
not the module that the ingress's own code imports. A counter kept in router.py was therefore a
second, private counter: GET /admin/router read an empty one while the router counted in its copy.
This module is imported by reference from both sides, so there is one count per process.

Light on purpose (no Ray import): the benchmark's report names the decisions from here too.
"""
from __future__ import annotations

import collections

FitClass = str  # "fits" | "fits_morphed" | "no_fit": how a request fits a replica's KV now
Decision = str  # a FitClass (of the chosen replica) | "overflow" | "stale" | "no_queue_len" | "other_call"
FIT_CLASSES: tuple[FitClass, ...] = ("fits", "fits_morphed", "no_fit")  # best first
# The decisions a `generate` call can get: its replica's fit class, the SLO overflow, or why the router
# fell back to Serve's default (stale stats, an unknown queue length).
GENERATE_DECISIONS: tuple[Decision, ...] = (*FIT_CLASSES, "overflow", "stale", "no_queue_len")
DECISIONS: tuple[Decision, ...] = (*GENERATE_DECISIONS, "other_call")  # + any call that is not a generation

_TALLY: collections.Counter[Decision] = collections.Counter()


def tally(decision: Decision) -> None:
    if decision not in DECISIONS:
        raise ValueError(f"unknown router decision {decision!r}; one of {DECISIONS}")
    _TALLY[decision] += 1


def decision_totals() -> dict[Decision, int]:
    """How many times the pressure-aware routers of this process decided each way (empty: none ran)."""
    return dict(_TALLY)
