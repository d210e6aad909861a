"""Every failure -> (status, OpenAI error body, headers): HTTPError raised by the routes, the
engine's errors, pydantic's validation errors (400 naming the parameter, not FastAPI's 422), and
faults (500, logged with the request id; the server keeps serving)."""
from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from deployments.protocol import UnsupportedFeature, error_body
from engine.errors import EngineOverloadedError, InvalidRequestError

logger = logging.getLogger("morphserve.ingress")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_payload(exc: BaseException, rid: str, retry_after_s: int) -> tuple[int, dict, dict[str, str]]:
    if isinstance(exc, HTTPError):
        return exc.status, error_body(exc.status, str(exc), exc.param, exc.code), {}
    if isinstance(exc, (InvalidRequestError, UnsupportedFeature)):
        return 400, error_body(400, str(exc), exc.param), {}
    if isinstance(exc, EngineOverloadedError):
        return 503, error_body(503, str(exc)), {"Retry-After": str(retry_after_s)}
    # A fault, not the client's: log it with the request id, answer 500, keep serving.
    logger.error("request %s failed", rid, exc_info=(type(exc), exc, exc.__traceback__))
    return 500, error_body(500, f"internal error while serving {rid}; the server log has details"), {}


def _union_tag(part: object) -> bool:
    """pydantic names the member of a union that failed ("str", "list[int]", "function-after[...]")
    in the error's location; the client's parameter path is the fields and indexes alone."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 details -> 400 with one OpenAI-style message naming the parameter."""
    parts, param = [], None
    for err in exc.errors()[:3]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body" and not _union_tag(x))
        param = param or (where or None)
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return JSONResponse(error_body(400, "; ".join(parts) or "invalid request body", param), status_code=400)
