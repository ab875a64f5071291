"""``asyncrl serve``: start the inference sidecar for ``model.name`` with the backend ``inference.backend``
names, chosen once here: ``hf``, asyncrl's app (:mod:`asyncrl.inference.builtin.server`) over the built-in
CPU engine (:mod:`asyncrl.inference.builtin`); ``vllm``, vLLM's server with asyncrl's routes
(:mod:`asyncrl.inference.vllm`)."""

from __future__ import annotations

import os
import sys

import uvicorn

from asyncrl.config import Config
from asyncrl.inference.admin import weights_roots
from asyncrl.inference.builtin.engine import HFEngine
from asyncrl.inference.builtin.engine_process import EngineProcess
from asyncrl.inference.builtin.server import build_app
from asyncrl.numerics import configure_torch
from asyncrl.utils.process import exit_wrapper, free_port, setup_logging

SWITCH_INTERVAL_S = 0.0005
# How long the sidecar keeps an idle HTTP connection open: longer than any client keeps one in its pool
# (httpx's default keepalive_expiry is 5 s, and verifiers' clients make no retries). At the servers' default
# of 5 s a client can send on a pooled connection just as the server closes it, and the episode fails
# ("Connection error").
KEEP_ALIVE_S = 65


def build_engine(cfg: Config):
    """The engine behind asyncrl's own server (backend 'hf'), in a process of its own so that decoding never
    holds the GIL the event loop needs; 'vllm' serves through vLLM's server."""
    if cfg.inference.backend == "hf":
        # numerics=reproducible promises CPU bits: a GPU in the machine must not pull the sidecar onto it
        device = "cpu" if cfg.numerics == "reproducible" else None
        if not cfg.inference.engine_process:
            return HFEngine(cfg.model, cfg.inference, cfg.seed, device=device)
        return EngineProcess(cfg.model, cfg.inference, cfg.seed, cfg.numerics, device=device)
    raise ValueError(f"inference.backend={cfg.inference.backend!r} has no asyncrl engine; allowed: 'hf'")


@exit_wrapper("inference")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    log = setup_logging("inference")
    port = cfg.inference.port or free_port(cfg.inference.host)
    log.info(f"serving {cfg.model.name} ({cfg.inference.backend}) at http://{cfg.inference.host}:{port}/v1")
    if cfg.inference.backend == "vllm":
        # lazy: the GPU-only backend, so that a CPU sidecar (and a CPU DVC stage) never loads it
        from asyncrl.inference.vllm import server as vllm_server

        os.environ["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(KEEP_ALIVE_S)  # vLLM's server reads it for uvicorn
        vllm_server.serve(cfg, port)
        return
    configure_torch(cfg.numerics, cfg.inference.num_threads)
    engine = build_engine(cfg)
    # a thread that runs Python (the tokenizer's; the engine's with inference.engine_process=false) keeps the
    # GIL for up to the switch interval (5 ms by default) each time the event loop asks for it
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(
        build_app(engine, cfg.inference, weights_roots(cfg)),
        host=cfg.inference.host,
        port=port,
        log_level=cfg.inference.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
        # admin routes trust loopback clients: an X-Forwarded-For header must never make a remote one look
        # local
        proxy_headers=False,
    )
