"""OpenAIIngress: the HTTP deployment. It serves the FastAPI app of deployments/ingress.py over a
HandleEngineClient to the LLMServer deployment (Ray Serve routes each call to one engine replica
and applies its back-pressure, which the client turns into 503)."""
from __future__ import annotations

from typing import Any

from ray import serve

from deployments.app_args import AppArgs
from deployments.engine_client import HandleEngineClient
from deployments.ingress import build_ingress_app


@serve.ingress()
class OpenAIIngress:
    def __init__(self, llm_server: Any, args: AppArgs | dict):
        self.args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
        self.engine = HandleEngineClient(llm_server, refusal_hold_s=self.args.ingress_refusal_hold_s)

    def __serve_build_asgi_app__(self):
        # Built on the replica (after __init__): metrics default to Ray metrics in here.
        return build_ingress_app(self.engine, self.args.ingress_settings())
