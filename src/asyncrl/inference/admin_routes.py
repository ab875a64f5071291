"""The admin routes both backends serve, declared once: ``GET /policy``, ``POST /pause``, ``POST /resume``,
``POST /update_weights`` and the rollout-scoped endpoints' ``/rollouts``
(:mod:`asyncrl.inference.recording`). A backend answers them through :class:`Backend`, chosen once, when its
app is built (:func:`admin_router`); only callers :func:`asyncrl.inference.admin.admin_refusal` lets through
reach the POSTs and the rollouts' routes."""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, Request

from asyncrl.inference.admin import admin_refusal
from asyncrl.inference.errors import BadRequest
from asyncrl.inference.protocol import UpdateWeightsRequest
from asyncrl.inference.recording import Rollouts, rollout_router


class Backend(Protocol):
    """What the admin routes ask of a serving backend (``request``: the route's, for what its app holds)."""

    @property
    def version(self) -> int: ...

    async def pause(self, request: Request) -> None: ...

    async def resume(self, request: Request) -> None: ...

    async def update_weights(self, body: UpdateWeightsRequest, request: Request) -> dict[str, Any]: ...


class _Bind:
    """The router's dependency: hands its routes the backend and the admin token through
    ``request.state``."""

    def __init__(self, backend: Backend, admin_token: str | None):
        self.backend, self.admin_token = backend, admin_token

    # async: run on the event loop, not in a worker thread
    async def __call__(self, request: Request) -> None:
        request.state.backend, request.state.admin_token = self.backend, self.admin_token


async def backend(request: Request) -> Backend:
    """The backend of the router that matched ``request``."""
    return request.state.backend


Served = Annotated[Backend, Depends(backend)]  # a route's parameter: the backend of its router


async def require_admin(request: Request) -> None:
    """Refuse (403) a caller that may not use admin routes, before its body is read."""
    host = request.client.host if request.client else None
    if refusal := admin_refusal(host, request.headers, request.state.admin_token):
        raise BadRequest(refusal, 403)


async def policy(served: Served) -> dict[str, Any]:
    return {"version": served.version}


async def pause(request: Request, served: Served) -> dict[str, Any]:
    await served.pause(request)
    return {"paused": True}


async def resume(request: Request, served: Served) -> dict[str, Any]:
    await served.resume(request)
    return {"paused": False}


async def update_weights(body: UpdateWeightsRequest, request: Request, served: Served) -> dict[str, Any]:
    return await served.update_weights(body, request)


def admin_router(served: Backend, admin_token: str | None, rollouts: Rollouts | None = None) -> APIRouter:
    """The admin routes over ``served``; ``admin_token``: the bearer token that admits a non-loopback caller;
    ``rollouts``: the sidecar's rollout-scoped endpoints, whose opening and ending are admin routes too."""
    router = APIRouter(dependencies=[Depends(_Bind(served, admin_token))])
    admin = [Depends(require_admin)]
    router.add_api_route("/policy", policy, methods=["GET"])
    router.add_api_route("/update_weights", update_weights, methods=["POST"], dependencies=admin)
    router.add_api_route("/pause", pause, methods=["POST"], dependencies=admin)
    router.add_api_route("/resume", resume, methods=["POST"], dependencies=admin)
    if rollouts is not None:
        router.include_router(rollout_router(rollouts), dependencies=admin)
    return router
