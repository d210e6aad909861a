"""IngressSettings: the HTTP front's knobs (AppArgs derives them; tests build them directly)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class IngressSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key: str | None = Field(None, description="when set, /v1/* needs 'Authorization: Bearer <api_key>'")
    admin_token: str | None = Field(None, description="when set, /admin/* needs 'Authorization: Bearer <admin_token>'; unset: admin is off (403)")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with 503 when the engine is full")
    completion_max_tokens: int = Field(16, ge=1, description="/v1/completions default max_tokens (OpenAI's); chat defaults to the context left")
    health_timeout_s: float = Field(5.0, gt=0, description="/health fails when the engine does not answer within this")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body accepted; larger -> 413 before it is read in full")
    max_choices: int = Field(64, ge=1, description="engine requests one HTTP request may start: n x the prompts in a batch")
    echo_request_id: bool = Field(True, description="add x-request-id to responses; False behind Ray Serve, whose proxy adds it")
