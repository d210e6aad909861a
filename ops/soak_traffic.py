"""Soak traffic: worker threads that send short chat requests while active, and record every one."""
from __future__ import annotations

import threading
import time

from ops.local_ray import http
from ops.soak_record import RequestRecord

MODEL = "SmolLM2-135M-Instruct"


class Traffic:
    def __init__(self, url: str, workers: int, max_tokens: int, prompt_words: int = 0, timeout_s: float = 300.0):
        self.url, self.max_tokens, self.timeout_s = url, max_tokens, timeout_s
        # A long shared preamble makes each request need several KV blocks, so a burst presses on
        # memory (what morphing relieves) and not only on compute.
        self.preamble = " ".join(f"word{i % 97}" for i in range(prompt_words))
        self.records: list[RequestRecord] = []
        self.replica_kills: list[float] = []
        self._active, self._stop = threading.Event(), threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)]
        for t in self._threads:
            t.start()

    def set_active(self, on: bool) -> None:
        (self._active.set if on else self._active.clear)()

    def mark_replica_kill(self, at: float) -> None:
        self.replica_kills.append(at)

    def _run(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            if not self._active.wait(0.5):
                continue
            body = {"model": MODEL, "max_tokens": self.max_tokens, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"{self.preamble} Tell me a story about the number {worker * 100000 + i}."}]}
            start = time.monotonic()
            status, _ = http("POST", self.url + "/v1/chat/completions", body, timeout_s=self.timeout_s)
            self.records.append(RequestRecord(start, time.monotonic(), status))
            i += 1
            if status == 503:
                self._stop.wait(1.0)  # honour Retry-After (the app sends 1 s)

    def stop(self) -> list[RequestRecord]:
        self._stop.set()
        self._active.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)
        return list(self.records)
