"""The worker side of the offline throughput benchmark: one backend (ours, Hugging Face, vLLM) loaded
once in its own process, answering the driver's commands one JSON line at a time.

Standard library only, because the vLLM worker runs in vLLM's own venv, which has none of ours.

    driver -> worker (stdin)   {"cmd": "run", "label": "a", "prompts": [[ids...], ...], "max_tokens": 64}
                               {"cmd": "quit"}
    worker -> driver           {"event": "ready", "load_s": 12.3, "info": {...}}             once, after loading
                               {"event": "done", "elapsed_s": ..., "cpu_s": ..., "prompt_tokens": ..., "generated_tokens": ...,
                                "vmhwm_kib": ..., "vmrss_kib": ...}                          per run
                               {"event": "error", "message": "..."}                          then exit 1

The protocol travels on a private copy of the original stdout; fd 1 itself is pointed at stderr, so
whatever the libraries print (vLLM logs, progress bars) can never corrupt a reply.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from typing import Callable, Protocol, Sequence


class OfflineBackend(Protocol):
    def info(self) -> dict: ...

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[int]:
        """Greedy, ignoring EOS; returns the number of tokens generated for each prompt, in order."""
        ...


def worker_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments every backend takes (the driver passes the same ones to all)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model-dir", required=True, help="Hugging Face folder of the model")
    ap.add_argument("--threads", type=int, required=True, help="CPU threads the backend may use")
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--kv-gib", type=float, required=True, help="KV cache space (GiB) where the backend preallocates it")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="per-step token budget (ours, vLLM)")
    return ap.parse_args(argv)


def proc_status_kib(field: str) -> int:
    """VmHWM (peak resident set) or VmRSS of this process in KiB, from /proc; ru_maxrss where /proc is absent."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _cpu_seconds() -> float:
    # User + system time of all this process's threads: unlike wall time, barely moved by other
    # processes competing for the cores (they delay us, they do not make us burn more CPU).
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_kib() -> int:
    # Any helper process a library forked counts too: the larger of our own peak and theirs.
    return max(proc_status_kib("VmHWM"), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


def serve(load: Callable[[], OfflineBackend]) -> None:
    """Load the backend, then answer commands until "quit" or end of input."""
    reply_stream = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        reply_stream.write(json.dumps(obj) + "\n")
        reply_stream.flush()

    try:
        t0 = time.perf_counter()
        backend = load()
        reply({"event": "ready", "load_s": time.perf_counter() - t0, "info": backend.info()})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                return
            reply(_run(backend, cmd))
    except Exception:  # the driver shows the message; nothing here can recover
        reply({"event": "error", "message": traceback.format_exc()})
        sys.exit(1)


def _run(backend: OfflineBackend, cmd: dict) -> dict:
    prompts, max_tokens = cmd["prompts"], int(cmd["max_tokens"])
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    counts = backend.generate(prompts, max_tokens)
    elapsed, cpu_s = time.perf_counter() - t0, _cpu_seconds() - cpu0
    if len(counts) != len(prompts) or any(c != max_tokens for c in counts):
        raise RuntimeError(f"run {cmd.get('label')}: expected {max_tokens} tokens for each of {len(prompts)} "
                           f"requests, got {counts}; the backend stopped early (is EOS really ignored?)")
    return {"event": "done", "label": cmd.get("label"), "elapsed_s": elapsed, "cpu_s": cpu_s,
            "prompt_tokens": sum(len(p) for p in prompts), "generated_tokens": sum(counts),
            "vmhwm_kib": _peak_kib(), "vmrss_kib": proc_status_kib("VmRSS")}
