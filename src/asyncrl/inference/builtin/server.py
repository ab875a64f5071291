"""The built-in backend's app: the sidecar's shared routes over a generation engine of this package.

The OpenAI and token routes (:mod:`asyncrl.inference.builtin.routes`) and the admin routes
(:mod:`asyncrl.inference.admin_routes`) are declared once; this module builds the app they run in: requests
that arrive together are decoded as one batch by :class:`~asyncrl.inference.builtin.batcher.Batcher`, the
engine runs in a process (``asyncrl serve``) or thread of its own so the event loop keeps answering, every
failure is answered in OpenAI's error shape (:mod:`asyncrl.inference.errors`), request bodies are bounded
(:mod:`asyncrl.inference.builtin.limits`), each rollout-scoped endpoint's calls are recorded
(:mod:`asyncrl.inference.recording`) and a burst of requests enters the app a share per turn of the event
loop, so ``/health`` stays prompt (:mod:`asyncrl.inference.builtin.admission`). If the engine's process dies
the server exits with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.admin_routes import admin_router
from asyncrl.inference.builtin import routes
from asyncrl.inference.builtin.admission import Admission
from asyncrl.inference.builtin.backend import BuiltinBackend, exit_when_dead
from asyncrl.inference.builtin.batcher import Batcher
from asyncrl.inference.builtin.engine import HFEngine
from asyncrl.inference.builtin.engine_process import EngineClient, EngineDied, EngineThread
from asyncrl.inference.builtin.limits import BodyLimit
from asyncrl.inference.errors import install_error_handlers
from asyncrl.inference.recording import RolloutEndpoints, Rollouts


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    sidecar: routes.Sidecar = app.state.sidecar
    tasks = [asyncio.create_task(sidecar.batcher.run()), asyncio.create_task(exit_when_dead(sidecar.engine))]
    yield
    for task in tasks:
        task.cancel()


def build_app(
    engine: HFEngine | EngineClient, cfg: InferenceConfig, roots: list[Path] | None = None
) -> FastAPI:
    """The sidecar's app over ``engine`` (an :class:`HFEngine` is driven by a thread of this process);
    ``roots``: where ``/update_weights`` may load from (``None`` = anywhere, for tests and embedding;
    ``asyncrl serve`` passes :func:`asyncrl.inference.admin.weights_roots`)."""
    if isinstance(engine, HFEngine):
        engine = EngineThread(engine)
    batcher = Batcher(engine, cfg)
    app = FastAPI(title="asyncrl inference sidecar", lifespan=_lifespan)
    app.state.sidecar = routes.Sidecar(
        engine, batcher, cfg, ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    )
    rollouts, max_bytes = Rollouts(), int(cfg.max_body_mb * 2**20)
    rollouts.version = lambda: engine.version
    app.add_middleware(RolloutEndpoints, rollouts=rollouts, served=engine.model_name, max_bytes=max_bytes)
    app.add_middleware(BodyLimit, max_bytes=max_bytes)
    app.add_middleware(Admission)  # added last, so outermost: a queued request has not had its body read yet
    install_error_handlers(app, unavailable=EngineDied)
    app.include_router(routes.router)
    app.include_router(admin_router(BuiltinBackend(engine, batcher, roots), cfg.admin_token, rollouts))
    return app
