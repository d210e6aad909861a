"""The OpenAI-compatible HTTP front, pure FastAPI without Ray (tests run it over a fake engine; in
Ray Serve, deployments/ingress_deployment.py builds it over a HandleEngineClient):

    settings.py    IngressSettings
    app.py         build_ingress_app: routes, middleware, error handlers
    server.py      the OpenAI handlers: model and context checks, tokenize, stream or collect
    admin.py       /admin/morph
    auth.py        bearer tokens (API key, admin token)
    errors.py      every failure -> status + OpenAI error body
    middleware.py  request ids
    sse.py         server-sent events, cancel on disconnect
"""
from deployments.ingress.app import build_ingress_app
from deployments.ingress.errors import HTTPError
from deployments.ingress.settings import IngressSettings

__all__ = ["build_ingress_app", "HTTPError", "IngressSettings"]
