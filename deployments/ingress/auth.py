"""Bearer tokens: the API key for /v1/* and the admin token for /admin/*, compared in constant time."""
from __future__ import annotations

import hmac

from fastapi import Request

from deployments.ingress.errors import HTTPError
from deployments.ingress.settings import IngressSettings


def bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    return value[7:].strip() if value[:7].lower() == "bearer " else None


def token_matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def api_key_guard(settings: IngressSettings):
    """A FastAPI dependency: 401 unless the request carries the API key (when one is set)."""
    async def require_api_key(request: Request) -> None:
        if settings.api_key is not None and not token_matches(bearer(request), settings.api_key):
            raise HTTPError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")
    return require_api_key


def admin_guard(settings: IngressSettings):
    """A FastAPI dependency: 403 while no admin token is configured, 401 without the right one."""
    async def require_admin(request: Request) -> None:
        if settings.admin_token is None:
            raise HTTPError(403, "the admin API is off; configure an admin_token to turn it on")
        if not token_matches(bearer(request), settings.admin_token):
            raise HTTPError(401, "missing or incorrect admin token; send 'Authorization: Bearer <admin_token>'",
                            code="invalid_admin_token")
    return require_admin
