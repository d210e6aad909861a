"""Upload the MorphServe dashboard to a running Grafana through its HTTP API (grafana-client).

    GRAFANA_TOKEN=glsa_... python -m ops.monitoring.upload_dashboard --url http://grafana:3000
    python -m ops.monitoring.upload_dashboard --user admin --password admin
    python -m ops.monitoring.upload_dashboard --dry-run     # print the payload, contact nothing

The dashboard lands in a folder (created when missing) and replaces any dashboard with the same uid
(overwrite), so running it again after a change is an upgrade, not a duplicate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DASHBOARD = Path(__file__).resolve().parent / "grafana" / "dashboards" / "morphserve.json"


@dataclass(frozen=True)
class UploadTarget:
    url: str
    credential: str | tuple[str, str] | None  # token, (user, password), or none (anonymous/URL)
    folder_title: str
    folder_uid: str


def load_dashboard(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"dashboard file {path} does not exist; pass --file or run "
                                "python -m ops.monitoring.build_dashboard")
    dashboard = json.loads(path.read_text())
    if not isinstance(dashboard, dict) or not dashboard.get("uid") or not dashboard.get("title"):
        raise ValueError(f"{path} is not a dashboard: it needs top-level 'uid' and 'title'")
    return dashboard


def build_payload(dashboard: dict[str, Any], folder_uid: str, message: str) -> dict[str, Any]:
    """The body of POST /api/dashboards/db. `id` must be null so Grafana matches on uid."""
    return {"dashboard": {**dashboard, "id": None}, "folderUid": folder_uid, "overwrite": True,
            "message": message}


def ensure_folder(api: Any, title: str, uid: str) -> str:
    from grafana_client.client import GrafanaClientError

    try:
        return api.folder.get_folder(uid)["uid"]
    except GrafanaClientError as err:
        if err.status_code != 404:
            raise
    return api.folder.create_folder(title, uid=uid)["uid"]


def upload(target: UploadTarget, payload: dict[str, Any]) -> dict[str, Any]:
    """Create the folder if needed and post the dashboard; returns Grafana's answer."""
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(target.url, credential=target.credential)
    folder_uid = ensure_folder(api, target.folder_title, target.folder_uid)
    return api.dashboard.update_dashboard({**payload, "folderUid": folder_uid})


def credential_from(args: argparse.Namespace) -> str | tuple[str, str] | None:
    if args.token:
        return args.token
    if args.user or args.password:
        if not (args.user and args.password):
            raise ValueError("basic auth needs both --user and --password "
                             "(or GRAFANA_USER and GRAFANA_PASSWORD)")
        return (args.user, args.password)
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=env("GRAFANA_URL", "http://127.0.0.1:3000"))
    parser.add_argument("--token", default=env("GRAFANA_TOKEN"), help="service-account token")
    parser.add_argument("--user", default=env("GRAFANA_USER"))
    parser.add_argument("--password", default=env("GRAFANA_PASSWORD"))
    parser.add_argument("--folder", default="MorphServe", help="folder title")
    parser.add_argument("--folder-uid", default="morphserve")
    parser.add_argument("--file", type=Path, default=DEFAULT_DASHBOARD)
    parser.add_argument("--message", default="uploaded by ops.monitoring.upload_dashboard")
    parser.add_argument("--dry-run", action="store_true", help="print the payload and stop")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    payload = build_payload(load_dashboard(args.file), args.folder_uid, args.message)
    if args.dry_run:
        print(json.dumps(payload, indent=2))
        return 0
    target = UploadTarget(args.url, credential_from(args), args.folder, args.folder_uid)
    answer = upload(target, payload)
    print(f"uploaded {payload['dashboard']['uid']} to {args.url}: "
          f"status={answer.get('status')} url={answer.get('url')} version={answer.get('version')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
