"""Checkpoint bookkeeping shared by the trainer, the orchestrator and the launcher.

``checkpoints/step_N/{trainer,orchestrator}/`` means "N steps are done": the trainer has published
``weights/step_N`` and the orchestrator has written ``rollouts/step_{N-1}``. A run resumes from the
newest N for which *both* parts are complete, at step N; the orchestrator then needs policy
``N - async_level``, so weights in that window are never pruned.
"""

from __future__ import annotations

from asyncrl.config import Config, ConfigError, resume_step
from asyncrl.paths import RunDir, list_steps, stable

PARTS = ("trainer", "orchestrator")


def is_checkpoint_step(done: int, interval: int, max_steps: int) -> bool:
    """Whether to checkpoint after ``done`` steps: every ``interval`` steps, and always at the end."""
    return done == max_steps or (interval > 0 and done % interval == 0)


def complete_checkpoints(run: RunDir) -> list[int]:
    return [s for s in list_steps(run.checkpoints, require_stable=False)
            if all(stable(run.checkpoint(s, p)) for p in PARTS)]


def resolve_resume(cfg: Config, run: RunDir) -> int | None:
    """The step to resume from (``ckpt.resume``), checked against what is on disk; ``None`` = fresh run."""
    want = resume_step(cfg)
    if want is None:
        return None
    have = complete_checkpoints(run)
    if not have:
        raise ConfigError(f"invalid config:\n  ckpt.resume={cfg.ckpt.resume!r} but {run.checkpoints} holds no "
                          "complete checkpoint (trainer and orchestrator)")
    step = have[-1] if want == -1 else want
    if step not in have:
        raise ConfigError(f"invalid config:\n  ckpt.resume={step} is not a complete checkpoint; available: {have}")
    if step > cfg.max_steps:
        raise ConfigError(f"invalid config:\n  ckpt.resume={step} is past max_steps={cfg.max_steps}; raise max_steps "
                          "(it is the total number of steps)")
    return step


def protected_weights(checkpoint_steps: list[int], async_level: int) -> set[int]:
    """Weight versions a resume from any of ``checkpoint_steps`` needs (policies N - k .. N)."""
    return {s - j for s in checkpoint_steps for j in range(async_level + 1) if s - j >= 0}
