"""The OpenAI error body (`{"error": {message, type, param, code}}`) and UnsupportedFeature."""
from __future__ import annotations

from pydantic import BaseModel

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "invalid_request_error", 500: "server_error",
               503: "overloaded_error"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    detail = ErrorDetail(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param,
                         code=code if code is not None else status)
    return ErrorResponse(error=detail).model_dump()


class UnsupportedFeature(ValueError):
    """A well-formed request asks for something this server does not do (-> 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param
