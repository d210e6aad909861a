"""CPU seconds a served system's processes spent during a replay, by role (engine replica, ingress,
fleet controller, Ray and Serve's own processes).

On a 2-core machine every CPU second that is not the engines' stepping threads is taken from them:
a fleet whose controller or router costs TPOT shows it here first. The benchmark's own process (load
generator, status sampler) is counted as `client`. Linux /proc for the server's processes (the
benchmark's server handling needs it anyway).
"""
from __future__ import annotations

import os
import resource
from pathlib import Path

from ops.bench.server_process import proc_stat_fields, session_pids

# Ray titles its worker processes "ray::<actor class>[.<method>]" (Serve: "ray::ServeReplica:<app>:<deployment>").
ROLES = (("LLMServer", "engine"), ("OpenAIIngress", "ingress"), ("FleetController", "controller"),
         ("ServeController", "serve"), ("ProxyActor", "serve"), ("raylet", "ray"), ("gcs_server", "ray"),
         ("dashboard", "ray"), ("log_monitor", "ray"), ("monitor.py", "ray"))
# The report's columns: the roles above, anything else in the server's session, and the benchmark's
# own process (load generator and status sampler), which shares the machine too.
CPU_ROLES = ("engine", "ingress", "controller", "serve", "ray", "other", "client")


def role_of(cmdline: str) -> str:
    for marker, role in ROLES:
        if marker in cmdline:
            return role
    return "other"


def _cpu_seconds(pid: int) -> tuple[str, float] | None:
    """(cmdline, user + system CPU seconds) of a live process, None when it is gone."""
    fields = proc_stat_fields(pid)
    if fields is None:
        return None
    try:
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return None
    return cmdline, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: stat's 14, 15


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuAccount:
    """`start()` before the replay, `stop()` after: CPU seconds per role spent in between, over every
    process of the server's session (a process that started meanwhile counts from zero) and this one."""

    def __init__(self, sid: int):
        self.sid = sid
        self._start: dict[int, float] = {}
        self._own_start = 0.0

    def _read(self) -> dict[int, tuple[str, float]]:
        return {pid: read for pid in session_pids(self.sid) if (read := _cpu_seconds(pid)) is not None}

    def start(self) -> None:
        self._start = {pid: seconds for pid, (_, seconds) in self._read().items()}
        self._own_start = _own_cpu_seconds()

    def stop(self) -> dict[str, float]:
        spent: dict[str, float] = {"client": _own_cpu_seconds() - self._own_start}
        for pid, (cmdline, seconds) in self._read().items():
            role = role_of(cmdline)
            spent[role] = spent.get(role, 0.0) + seconds - self._start.get(pid, 0.0)
        return {role: round(s, 2) for role, s in sorted(spent.items())}
