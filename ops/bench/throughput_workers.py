"""The driver side of the offline-worker protocol (ops/bench/offline_worker.py): start a backend in its
own process, wait for it to load, send it runs, read its replies with a deadline, stop it."""
from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Sequence

from ops.bench import BenchmarkInputError

REPO_ROOT = Path(__file__).resolve().parents[2]
MODULES = {"ours": "ops.bench.ours_offline", "hf": "ops.bench.hf_offline", "vllm": "ops.bench.vllm_offline"}


class WorkerFailed(RuntimeError):
    """A backend process died, timed out or reported an error; the message ends with its log's tail."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    backend: str  # "ours" | "hf" | "vllm"
    python: Path  # the interpreter of the venv the backend lives in
    args: tuple[str, ...]  # worker_args(): --model-dir ... --threads ... (same for every backend)
    log_path: Path


def python_for(backend: str, vllm_python: Path, own_python: Path) -> Path:
    if backend != "vllm":
        return own_python
    if not vllm_python.is_file():
        raise BenchmarkInputError(f"vLLM's venv interpreter {vllm_python} does not exist; run "
                                  f"ops/bench/setup_vllm.sh (or pass --vllm-python, or --skip-vllm)")
    return vllm_python


class WorkerProcess:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.ready: dict | None = None
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = spec.log_path.open("w", encoding="utf-8")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen([str(spec.python), "-m", MODULES[spec.backend], *spec.args], cwd=REPO_ROOT,
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, bufsize=1)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self, timeout_s: float) -> dict:
        self.ready = self._read(timeout_s, "loading")
        if self.ready.get("event") != "ready":
            raise self._failed(f"expected a ready message, got {self.ready}")
        return self.ready

    def run(self, label: str, prompts: Sequence[Sequence[int]], max_tokens: int, timeout_s: float) -> dict:
        self._send({"cmd": "run", "label": label, "prompts": [list(p) for p in prompts], "max_tokens": max_tokens})
        reply = self._read(timeout_s, f"run {label}")
        if reply.get("event") != "done":
            raise self._failed(f"run {label}: {reply.get('message', reply)}")
        return reply

    def close(self, timeout_s: float = 30.0) -> None:
        if self._proc.poll() is None:
            try:
                self._send({"cmd": "quit"})
                self._proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def _send(self, obj: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except OSError as e:
            raise self._failed(f"cannot send a command ({e})") from None

    def _read(self, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._proc.kill()
                raise self._failed(f"{what} took longer than {timeout_s:.0f}s (raise --timeout on a busy machine)")
            ready, _, _ = select.select([self._proc.stdout], [], [], min(left, 5.0))
            if ready:
                line = self._proc.stdout.readline()
                if not line:
                    self._proc.wait()
                    raise self._failed(f"the process exited (code {self._proc.returncode}) during {what}")
                reply = json.loads(line)
                if reply.get("event") == "error":
                    raise self._failed(f"{what}: {reply.get('message')}")
                return reply

    def _failed(self, message: str) -> WorkerFailed:
        self._log.flush()
        try:
            tail = self.spec.log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        except OSError:
            tail = ""
        return WorkerFailed(f"{self.spec.backend} worker (pid {self._proc.pid}): {message}\n"
                            f"--- last lines of {self.spec.log_path} ---\n{tail}")
