"""What every local run of the app shares (tests, the soak): a Ray start that survives a slow raylet,
and a plain HTTP call that never raises on an error status."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

RAYLET_WAIT_S = "180"  # Ray's own default is 30 s; a loaded 2-core machine needs longer
START_ATTEMPTS = 3


def init_local_ray(**kwargs: Any):
    """ray.init(address="local", **kwargs), tried again when the raylet timed out during startup
    (Ray gives it a fixed time; on a machine whose cores are oversubscribed its agents import slower)."""
    import ray

    os.environ.setdefault("RAY_raylet_start_wait_time_s", RAYLET_WAIT_S)
    for attempt in range(START_ATTEMPTS):
        try:
            return ray.init(address="local", **kwargs)
        except Exception as e:  # noqa: BLE001
            ray.shutdown()
            if "timed out during startup" not in str(e) or attempt == START_ATTEMPTS - 1:
                raise


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout_s: float = 120.0) -> tuple[int, Any]:
    """(status, parsed JSON body or text) without raising on 4xx/5xx; (0, reason) when unreachable.
    `body`: JSON-serialisable, or raw bytes sent as they are."""
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
        return 0, str(err)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")
