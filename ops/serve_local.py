"""`make run`: the Serve application on one machine, reachable from this machine only by default.

    python -m ops.serve_local [key=value ...]            # AppArgs, as for `serve run deployments:build_app`
    HOST=0.0.0.0 python -m ops.serve_local               # open the HTTP API (and Ray's agents) to the network
    PORT=8080 python -m ops.serve_local mode=accuracy

`serve run` starts its local Ray cluster on the machine's network address, with the metrics agent
(`ray_morphserve_*`, no login) on all interfaces. On Linux, Ray turns a node address of 127.0.0.1
into the network address unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (the single-machine mode Ray
uses on macOS and Windows); with it, the node address is 127.0.0.1 and the GCS, raylet, workers,
Ray's agents and the Serve proxy listen on loopback. What still binds to every interface (one Ray
Serve port per replica) and how to close it is in README.md ("Network exposure"). Ctrl-C or
SIGTERM stops Serve and the cluster.
"""
from __future__ import annotations

import os
import signal
import sys
import time

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_kv(argv: list[str]) -> dict[str, object]:
    """`key=value` pairs, values parsed as YAML scalars/maps like `serve run` does (1GiB stays a string)."""
    import yaml

    args: dict[str, object] = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"arguments are key=value (AppArgs fields); got {item!r}")
        args[key] = yaml.safe_load(value)
    return args


def _stop(signum, frame):  # SIGTERM (and SIGINT where a shell ignored it) end the run like Ctrl-C
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    host = os.environ.get("HOST", "127.0.0.1")
    port = int(os.environ.get("PORT", "8000"))
    if host in LOOPBACK:  # read by Ray at import, and inherited by the raylet and every worker
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray import serve

    from deployments import build_app

    app = build_app(parse_kv(sys.argv[1:] if argv is None else argv))  # bad args fail before Ray starts
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    ray.init(include_dashboard=False, namespace="serve")
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name="default", route_prefix="/", blocking=False)
        print(f"MorphServe on http://{host}:{port} (Ctrl-C stops it)", flush=True)
        while True:
            time.sleep(3600)  # the app runs in Ray; this process only holds the cluster open
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
