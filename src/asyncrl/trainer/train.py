"""``asyncrl train``: the RL trainer (Lightning Fabric; one device on CPU, FSDP on GPUs).

This entry module stays torch-free until :func:`asyncrl.numerics.configure_torch` has set the environment
torch reads when it is imported; the loop itself is :func:`asyncrl.trainer.loop.train`.
"""

from __future__ import annotations

import logging

from asyncrl.checkpoint import resolve_resume
from asyncrl.config import Config
from asyncrl.numerics import configure_torch
from asyncrl.paths import RunDir
from asyncrl.utils.atomic import write_text_atomic
from asyncrl.utils.process import exit_wrapper, setup_logging

log = logging.getLogger("asyncrl.trainer")


@exit_wrapper("trainer")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    setup_logging("trainer")
    configure_torch(cfg.numerics, cfg.trainer.fabric.num_threads)
    # torch (and with it vLLM) is imported only now, after configure_torch set its environment
    if cfg.numerics == "bitwise":  # vLLM's batch-invariant mode, before CUDA is initialised
        from asyncrl.models import bitwise  # lazy: torch loads after configure_torch

        bitwise.enable()
    from asyncrl.config.compose import to_yaml  # lazy: torch loads after configure_torch
    from asyncrl.trainer.loop import train  # lazy: torch loads after configure_torch
    from asyncrl.utils.seed import seed_everything  # lazy: torch loads after configure_torch

    run = RunDir(cfg.run_dir).create()
    resume = resolve_resume(cfg, run)
    cfg_yaml = to_yaml(cfg)
    # every rank writes it (the rank is known only once Fabric is up): atomically, so that ranks sharing the
    # run directory (one machine, or nodes on a shared filesystem) never leave it torn
    write_text_atomic(run.configs / "trainer.yaml", cfg_yaml)
    seed_everything(cfg.seed, cfg.deterministic)
    train(cfg, run, resume, cfg_yaml, overrides)
