"""/admin/morph: read the replica's morph status, pin the mode or the number of quantized layers.
/admin/router: the pressure-aware router's decisions in this ingress replica so far (empty with
Serve's default router). Our own API (not OpenAI's), behind the admin token."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from deployments import protocol as p
from deployments.engine_client import AdminUpdate, EngineClient
from deployments.ingress.auth import admin_guard
from deployments.ingress.errors import HTTPError
from deployments.ingress.server import IngressServer


async def admin_set(engine: EngineClient, body: p.MorphAdminRequest) -> dict:
    """Shape checks here; whether the pin fits the model (its number of layers) is the replica's
    to say, at this call, so an impossible pin is a 400 now rather than a refusal every round."""
    if body.precision is not None and body.quantized_layers is None:
        raise HTTPError(400, "precision applies to quantized_layers; send both", param="precision")
    if body.mode is None and body.morphing_enabled is None and body.quantized_layers is None:
        raise HTTPError(400, "send at least one of mode, morphing_enabled, quantized_layers")
    return await engine.admin_set(AdminUpdate(**body.model_dump()))


def admin_router(server: IngressServer) -> APIRouter:
    admin = APIRouter(prefix="/admin", dependencies=[Depends(admin_guard(server.settings))])

    @admin.get("/morph")
    async def morph_status(request: Request) -> Response:
        return await server.guarded(request, server.engine.admin_status)

    @admin.post("/morph")
    async def morph_set(request: Request, body: p.MorphAdminRequest) -> Response:
        return await server.guarded(request, lambda: admin_set(server.engine, body))

    @admin.get("/router")
    async def router_status() -> dict:
        # The router runs in this process (inside the ingress's handle to the engines), so its tally is here.
        from deployments.router_decisions import decision_totals

        return {"decisions": decision_totals()}

    return admin
