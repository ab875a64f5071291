"""``asyncrl serve``: start the inference sidecar for ``model.name`` with the configured backend."""

from __future__ import annotations

from asyncrl.config import Config
from asyncrl.utils.process import exit_wrapper, free_port, set_torch_threads, setup_logging


def build_engine(cfg: Config):
    """The generation engine of ``inference.backend`` (closed set; vLLM serves through its own server)."""
    if cfg.inference.backend == "hf":
        from asyncrl.inference.engine import HFEngine

        return HFEngine(cfg.model, cfg.inference, cfg.seed)
    raise ValueError(f"inference.backend={cfg.inference.backend!r} is not allowed; allowed values: 'hf'")


@exit_wrapper("inference")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    log = setup_logging("inference")
    set_torch_threads(cfg.inference.num_threads)
    import uvicorn

    from asyncrl.inference.server import build_app

    engine = build_engine(cfg)
    port = cfg.inference.port or free_port(cfg.inference.host)
    log.info(f"serving {cfg.model.name} ({cfg.inference.backend}) at http://{cfg.inference.host}:{port}/v1")
    uvicorn.run(build_app(engine, cfg.inference), host=cfg.inference.host, port=port,
                log_level=cfg.inference.log_level, timeout_graceful_shutdown=5)
