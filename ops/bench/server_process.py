"""One server under test as a subprocess: start it in its own session, wait for readiness with a
deadline, and always clean up (SIGINT, then SIGTERM, then SIGKILL) every process of that session.

Ray and vLLM both start helper processes; they inherit the session id of the process we start, so
ending "everything in our session" ends exactly what this benchmark started and nothing else.
"""
from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

from ops.bench import BenchmarkInputError


class ServerStartError(BenchmarkInputError):
    """The server exited or missed its readiness deadline; the message points at its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, headers: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def http_post_json(url: str, body: str, headers: Mapping[str, str] | None = None,
                   timeout_s: float = 60.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json", **dict(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


class ServerProcess:
    """`with ServerProcess(cmd, env, log) as server: server.wait_ready(url, 300)` — stopped on exit."""

    def __init__(self, command: Sequence[str], log_path: str | Path, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None):
        self.command = list(command)
        self.log_path = Path(log_path)
        self.env = {**os.environ, **dict(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.cwd, start_new_session=True, stdin=subprocess.DEVNULL)
        finally:
            log.close()  # the child holds its own copy
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, url: str, deadline_s: float, poll_s: float = 1.0) -> float:
        """Poll `url` until it answers 200; seconds it took. Raises ServerStartError when the process
        exits or the deadline passes (the caller's `with` then cleans up)."""
        start = time.monotonic()
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise ServerStartError(f"{self.command[0]} exited (code {self.proc and self.proc.returncode}) "
                                       f"before {url} answered; see {self.log_path}")
            try:
                status, _ = http_get(url, timeout_s=5.0)
                if status == 200:
                    return time.monotonic() - start
            except (OSError, ValueError, http.client.HTTPException):
                # not listening yet, or something else answers on the port (seen once: a non-HTTP reply,
                # BadStatusLine, while Ray was starting); the deadline and the caller's retry bound it
                pass
            if time.monotonic() - start > deadline_s:
                raise ServerStartError(f"{url} not ready after {deadline_s:g} s; see {self.log_path}")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None:
            return
        sid = self.proc.pid  # start_new_session: the session id is the leader's pid
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            pids = session_pids(sid)
            if not pids:
                break
            for pid in pids:
                _signal(pid, sig)
            _wait_gone(sid, wait_s)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None


def proc_stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (comm) " (state first: field 3 of the file is [0]),
    or None when the process is gone. Linux only."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()  # comm may hold spaces and parentheses


def session_pids(sid: int) -> list[int]:
    """Live processes whose session id is `sid` (Linux /proc; field 6 of /proc/<pid>/stat)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = proc_stat_fields(entry.name)
        if fields is not None and len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(sid: int, wait_s: float) -> None:
    end = time.monotonic() + wait_s
    while time.monotonic() < end and session_pids(sid):
        time.sleep(0.2)
