"""The run directory before an RL run starts: ``asyncrl reconcile``, and the first thing ``asyncrl rl`` does.

A fresh run refuses a ``run_dir`` that already holds one (unless ``launcher.overwrite=true``, which empties
it). A resume (``ckpt.resume``) picks the checkpoint, verifying it completely, and removes what the
interrupted run wrote after it (:func:`asyncrl.checkpoint.reconcile`): one owner, before any process reads
the directory. ``asyncrl rl`` does this itself; under docker compose the one-shot ``reconcile`` service
does it before the trainer and the orchestrator start.
"""

from __future__ import annotations

import logging
import shutil

from asyncrl.checkpoint import reconcile, resolve_resume
from asyncrl.config import Config, ConfigError
from asyncrl.paths import RunDir, list_steps
from asyncrl.utils.process import exit_wrapper, setup_logging

log = logging.getLogger("asyncrl.rl")


def prepare_run_dir(cfg: Config, run: RunDir, overwrite: bool) -> int | None:
    """Validate resume/overwrite against what is on disk; clean up after the checkpoint on resume."""
    resume = resolve_resume(cfg, run)
    if resume is None:
        used = list_steps(run.weights, require_stable=False) or list_steps(
            run.rollouts, require_stable=False
        )
        if used and not overwrite:
            raise ConfigError(
                f"invalid config:\n  run_dir={cfg.run_dir} already holds a run; pass ckpt.resume=latest "
                "to continue it, launcher.overwrite=true to replace it, or choose another run_dir"
            )
        if used:
            shutil.rmtree(run.root)
        return None
    # steps after the checkpoint are redone: what the interrupted run wrote for them goes, before any
    # process (or this launcher's progress line) reads the run directory
    removed = reconcile(run, resume)
    log.info(
        f"resuming from checkpoint step {resume}"
        + (f"; removed what was written after it: {', '.join(removed)}" if removed else "")
    )
    return resume


@exit_wrapper("reconcile")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    setup_logging("reconcile")
    resume = prepare_run_dir(cfg, RunDir(cfg.run_dir), cfg.launcher.overwrite)
    if resume is None:
        log.info(f"run_dir={cfg.run_dir}: a fresh run; nothing to reconcile")
