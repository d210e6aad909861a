"""build_ingress_app: the FastAPI app (routes, middleware, error handlers) over an EngineClient."""
from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import protocol as p
from deployments.engine_client import EngineClient
from deployments.ingress.admin import admin_router
from deployments.ingress.auth import api_key_guard
from deployments.ingress.errors import HTTPError, validation_error
from deployments.ingress.middleware import BodyLimitMiddleware, RequestIdMiddleware
from deployments.ingress.server import IngressServer
from deployments.ingress.settings import IngressSettings
from deployments.metrics import ServeMetrics


def morphserve_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("morphserve")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"


def build_ingress_app(engine: EngineClient, settings: IngressSettings | None = None,
                      metrics: ServeMetrics | None = None) -> FastAPI:
    """The FastAPI app over `engine`. `metrics` defaults to ServeMetrics for the served model (Ray
    metrics inside a Serve replica, in memory elsewhere)."""
    server = IngressServer(engine, settings or IngressSettings(), metrics)
    app = FastAPI(title="MorphServe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(BodyLimitMiddleware, max_bytes=server.settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware, echo_header=server.settings.echo_request_id)  # outermost

    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc)

    async def http_error(request: Request, exc: HTTPError) -> JSONResponse:
        status, body, headers = server.error_payload(exc, request.state.request_id)
        return JSONResponse(body, status_code=status, headers=headers)

    async def starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405
        return JSONResponse(p.error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPError, http_error)
    app.add_exception_handler(StarletteHTTPException, starlette_error)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_key_guard(server.settings))])

    @v1.get("/models")
    async def models(request: Request) -> Response:
        return await server.guarded(request, server.models)

    @v1.post("/completions")
    async def completions(request: Request, body: p.CompletionRequest) -> Response:
        return await server.guarded(request, lambda: server.completions(request, body))

    @v1.post("/chat/completions")
    async def chat(request: Request, body: p.ChatCompletionRequest) -> Response:
        return await server.guarded(request, lambda: server.chat(request, body))

    @v1.get("/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await server.guarded(request, lambda: server.model(model_id))

    vllm = APIRouter(dependencies=[Depends(api_key_guard(server.settings))])  # vLLM's own routes

    @vllm.post("/tokenize")
    async def tokenize(request: Request, body: p.TokenizeRequest) -> Response:
        return await server.guarded(request, lambda: server.tokenize(body))

    @vllm.post("/detokenize")
    async def detokenize(request: Request, body: p.DetokenizeRequest) -> Response:
        return await server.guarded(request, lambda: server.detokenize(body))

    async def version() -> dict:
        return {"version": morphserve_version()}

    app.include_router(v1)
    app.include_router(vllm)
    app.add_api_route("/version", version, methods=["GET"])
    app.include_router(admin_router(server))
    app.add_api_route("/health", server.health, methods=["GET"])
    return app
