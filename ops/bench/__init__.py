"""Bursty-trace replay benchmark.

Pipeline (one file per step):
  traces.py   CSV (Azure LLM inference, BurstGPT)          -> Trace of TraceRequest
  workload.py window selection + time/token scaling (spec)  -> Workload
  prompts.py  ShareGPT prompts fitted to each request's length -> BenchPrompt (prompt + reference answer)
  loadgen.py  open-loop replay against an OpenAI-compatible server -> LoadResult (RequestRecord, ServerSample)
  metrics.py  per-run latency/SLO/goodput numbers, repeats aggregated as median [min, max]
  report.py   SystemRun / BenchResults records -> report.md, results.json, PNG plots
Quality (ROUGE-L agreement) lives in ops/quality/rouge.py.
"""
from engine.errors import MorphServeError


class BenchmarkInputError(MorphServeError, ValueError):
    """A trace file, workload parameter or benchmark setting is unusable; the message says what to change."""
