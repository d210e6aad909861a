"""Request-arrival traces: the Azure LLM inference CSV and the BurstGPT CSV -> one `Trace` record.

Azure (Patel et al., Splitwise):  TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:15:46.6805900,374,44          (wall-clock, 7 fractional digits)
BurstGPT (Wang et al.):            Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type
    5.0, ChatGPT, 472, 18, 490, Conversation log  (seconds; spaces after commas are common)

Arrivals are made relative to the first request, and requests are sorted by arrival (stable), so every
later step can assume `requests[0].arrival_s == 0` and non-decreasing arrivals.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
from pathlib import Path

from ops.bench import BenchmarkInputError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the trace's first request
    prompt_tokens: int
    output_tokens: int


@dataclasses.dataclass(frozen=True)
class Trace:
    name: str  # "azure" or "burstgpt"
    source: str  # the file it was read from
    requests: tuple[TraceRequest, ...]
    dropped_rows: int = 0  # rows skipped on purpose (BurstGPT failures with zero tokens)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def check_integrity(self) -> None:
        """Arrivals start at 0 and never go back; token counts are positive."""
        if not self.requests:
            return
        if self.requests[0].arrival_s != 0.0:
            raise AssertionError(f"first arrival is {self.requests[0].arrival_s}, not 0")
        for a, b in zip(self.requests, self.requests[1:]):
            if b.arrival_s < a.arrival_s:
                raise AssertionError("arrivals are not sorted")
        if any(r.prompt_tokens <= 0 or r.output_tokens <= 0 for r in self.requests):
            raise AssertionError("a request has a non-positive token count")


def load_trace(path: str | Path) -> Trace:
    """Load either format, chosen by the header row (never by the file name)."""
    header = _read_header(Path(path))
    if "TIMESTAMP" in header:
        return load_azure_trace(path)
    if "Timestamp" in header:
        return load_burstgpt_trace(path)
    raise BenchmarkInputError(
        f"{path}: header {header} is neither the Azure trace ({', '.join(AZURE_COLUMNS)}) "
        f"nor BurstGPT ({', '.join(BURSTGPT_COLUMNS)}); pass one of those CSV files")


def load_azure_trace(path: str | Path) -> Trace:
    rows = _read_rows(Path(path), AZURE_COLUMNS)
    timed, dropped = [], 0
    for line_no, row in rows:
        when = _parse_azure_time(row["TIMESTAMP"], path, line_no)
        prompt = _parse_int(row["ContextTokens"], "ContextTokens", path, line_no)
        output = _parse_int(row["GeneratedTokens"], "GeneratedTokens", path, line_no)
        if prompt == 0 or output == 0:  # nothing to replay; counted like BurstGPT's failures
            dropped += 1
            continue
        timed.append((when, prompt, output))
    if not timed:
        raise BenchmarkInputError(f"{path}: no usable request rows after the header ({dropped} zero-token rows)")
    start = min(t for t, _, _ in timed)
    pairs = [((t - start).total_seconds(), p, o) for t, p, o in timed]
    return _make_trace("azure", path, pairs, dropped)


def load_burstgpt_trace(path: str | Path, model: str | None = None, log_type: str | None = None) -> Trace:
    """`model` / `log_type` keep only rows whose Model / Log Type equal them (e.g. "ChatGPT",
    "Conversation log"). Rows with zero request or response tokens are failed requests in BurstGPT;
    they are dropped and counted in `dropped_rows`."""
    rows = _read_rows(Path(path), BURSTGPT_COLUMNS)
    pairs, dropped = [], 0
    for line_no, row in rows:
        if model is not None and row.get("Model", "").strip() != model:
            continue
        if log_type is not None and row.get("Log Type", "").strip() != log_type:
            continue
        arrival = _parse_float(row["Timestamp"], "Timestamp", path, line_no)
        prompt = _parse_int(row["Request tokens"], "Request tokens", path, line_no)
        output = _parse_int(row["Response tokens"], "Response tokens", path, line_no)
        if prompt == 0 or output == 0:
            dropped += 1
            continue
        pairs.append((arrival, prompt, output))
    if not pairs:
        raise BenchmarkInputError(
            f"{path}: no usable rows (dropped {dropped} zero-token rows; filters model={model!r}, "
            f"log_type={log_type!r}); check the filters or the file")
    start = min(a for a, _, _ in pairs)
    return _make_trace("burstgpt", path, [(a - start, p, o) for a, p, o in pairs], dropped)


def _make_trace(name: str, path, pairs: list[tuple[float, int, int]], dropped: int) -> Trace:
    pairs.sort(key=lambda x: x[0])  # stable: equal timestamps keep file order
    requests = tuple(TraceRequest(arrival_s=a, prompt_tokens=p, output_tokens=o) for a, p, o in pairs)
    trace = Trace(name=name, source=str(path), requests=requests, dropped_rows=dropped)
    trace.check_integrity()
    return trace


def _read_header(path: Path) -> list[str]:
    if not path.is_file():
        raise BenchmarkInputError(f"trace file {path} does not exist; pass the path of a trace CSV")
    with path.open(newline="", encoding="utf-8") as f:
        return [c.strip() for c in next(csv.reader(f), [])]


def _read_rows(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    header = _read_header(path)
    missing = [c for c in required if c not in header]
    if missing:
        raise BenchmarkInputError(
            f"{path}: missing column(s) {missing}; the header is {header}, expected {list(required)}")
    rows = []
    with path.open(newline="", encoding="utf-8") as f:
        # skipinitialspace tolerates "a, b, c"; header names are stripped above and here alike.
        reader = csv.reader(f, skipinitialspace=True)
        next(reader)
        for line_no, cells in enumerate(reader, start=2):
            if not cells or all(not c.strip() for c in cells):
                continue
            if len(cells) < len(header):
                raise BenchmarkInputError(
                    f"{path}:{line_no}: {len(cells)} cells, the header has {len(header)}; fix or remove the row")
            rows.append((line_no, {h: c.strip() for h, c in zip(header, cells)}))
    return rows


def _parse_azure_time(text: str, path, line_no: int) -> datetime.datetime:
    # The trace has 7 fractional digits (100 ns); datetime keeps microseconds, which is plenty for
    # arrival times. Cut the fraction ourselves so every Python version accepts the string.
    base, _, frac = text.partition(".")
    try:
        when = datetime.datetime.fromisoformat(base)
        micros = int((frac + "000000")[:6]) if frac else 0
    except ValueError:
        raise BenchmarkInputError(
            f"{path}:{line_no}: TIMESTAMP {text!r} is not like '2023-11-16 18:15:46.6805900'") from None
    return when.replace(microsecond=micros)


def _parse_int(text: str, column: str, path, line_no: int) -> int:
    try:
        value = int(float(text))  # some exports write "44.0"
    except ValueError:
        raise BenchmarkInputError(f"{path}:{line_no}: {column} {text!r} is not a number") from None
    if value < 0:
        raise BenchmarkInputError(f"{path}:{line_no}: {column} is negative ({value})")
    return value


def _parse_float(text: str, column: str, path, line_no: int) -> float:
    try:
        return float(text)
    except ValueError:
        raise BenchmarkInputError(f"{path}:{line_no}: {column} {text!r} is not a number") from None
