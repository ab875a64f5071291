"""``asyncrl serve``: start the inference sidecar for ``model.name`` with the configured backend."""

from __future__ import annotations

import sys

from asyncrl.config import Config
from asyncrl.numerics import configure_torch
from asyncrl.utils.process import exit_wrapper, free_port, setup_logging

SWITCH_INTERVAL_S = 0.0005


def build_engine(cfg: Config):
    """The engine behind asyncrl's own server (backend 'hf'); 'vllm' serves through vLLM's server."""
    if cfg.inference.backend == "hf":
        from asyncrl.inference.engine import HFEngine

        # numerics=reproducible promises CPU bits: a GPU in the machine must not pull the sidecar onto it
        return HFEngine(cfg.model, cfg.inference, cfg.seed, device="cpu" if cfg.numerics == "reproducible" else None)
    raise ValueError(f"inference.backend={cfg.inference.backend!r} has no asyncrl engine; allowed: 'hf'")


@exit_wrapper("inference")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    log = setup_logging("inference")
    port = cfg.inference.port or free_port(cfg.inference.host)
    log.info(f"serving {cfg.model.name} ({cfg.inference.backend}) at http://{cfg.inference.host}:{port}/v1")
    if cfg.inference.backend == "vllm":
        from asyncrl.inference.vllm_server import serve

        serve(cfg, port)
        return
    configure_torch(cfg.numerics, cfg.inference.num_threads)
    import uvicorn

    from asyncrl.inference.admin import weights_roots
    from asyncrl.inference.server import build_app

    engine = build_engine(cfg)
    # the engine thread runs Python between torch ops and keeps the GIL for up to the switch interval (5 ms by
    # default) each time the event loop asks for it: under a burst that added up to seconds of /health latency
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(
        build_app(engine, cfg.inference, weights_roots(cfg)),
        host=cfg.inference.host,
        port=port,
        log_level=cfg.inference.log_level,
        timeout_graceful_shutdown=5,
        # admin routes trust loopback clients: an X-Forwarded-For header must never make a remote one look local
        proxy_headers=False,
    )
