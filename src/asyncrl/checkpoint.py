"""Checkpoint bookkeeping shared by the trainer, the orchestrator and the launcher.

``checkpoints/step_N/{trainer,orchestrator}/`` means "N steps are done": the trainer has published
``weights/step_N`` and the orchestrator has written ``rollouts/step_{N-1}``. A run resumes from the newest N
whose parts are both complete *and verify* (their manifests, :func:`asyncrl.utils.atomic.verify_sealed`, and
the weights ``N - async_level .. N`` the orchestrator needs next); a checkpoint that a crash or a full disk
left short is skipped for the previous one, with a log line. Before anything restarts, :func:`reconcile`
removes what the interrupted run wrote after the checkpoint, once, so every reader starts from a run
directory that looks as if the run had stopped exactly there. SFT checkpoints have the trainer part only and
resume the same way (``sft=True``).

Reading every byte of a checkpoint to check its sha256 takes a while for a large model: the process that
chooses the step (the launcher, or ``asyncrl reconcile`` under compose) checks the digests, and passes the
step it checked to its children in :data:`VERIFIED_ENV`, which then check sizes only.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from asyncrl.config import Config, ConfigError, resume_step
from asyncrl.monitor import truncate_jsonl
from asyncrl.paths import RunDir, list_steps, stable
from asyncrl.utils.atomic import remove_dir, verify_sealed

log = logging.getLogger("asyncrl.checkpoint")

PARTS = ("trainer", "orchestrator")
SFT_PARTS = ("trainer",)
# set by a parent that verified checkpoint <path> completely (digests) for its children
VERIFIED_ENV = "ASYNCRL_VERIFIED_CHECKPOINT"


def is_checkpoint_step(done: int, interval: int, max_steps: int) -> bool:
    """Whether to checkpoint after ``done`` steps: every ``interval`` steps, and always at the end."""
    return done == max_steps or (interval > 0 and done % interval == 0)


def complete_checkpoints(run: RunDir, parts: tuple[str, ...] = PARTS) -> list[int]:
    """Steps whose ``parts`` all carry their marker (not yet verified)."""
    return [
        s
        for s in list_steps(run.checkpoints, require_stable=False)
        if all(stable(run.checkpoint(s, p)) for p in parts)
    ]


def policy_window(step: int, async_level: int) -> range:
    """The policies that may generate the rollouts of step ``step`` with ``async_level = k``:
    ``max(0, step - k) .. step``. The one rule for which policy versions must still exist: the orchestrator
    samples step ``step`` from one of them (:mod:`asyncrl.transport.policy`), a resume from checkpoint
    ``step`` loads them from disk (:func:`needed_weights`), and a streamed transport writes the ones a
    checkpoint needs as files (:func:`asyncrl.transport.streamed.sent_directly`)."""
    return range(max(0, step - async_level), step + 1)


def needed_weights(step: int, async_level: int) -> list[int]:
    """Weight versions a resume from ``step`` loads from disk: the published policies of its window (0 is the
    starting model, not a published version)."""
    return [v for v in policy_window(step, async_level) if v > 0]


def checkpoint_problem(
    run: RunDir, step: int, async_level: int | None, parts: tuple[str, ...] = PARTS, digest: bool = True
) -> str | None:
    """Why checkpoint ``step`` cannot be resumed from (``None`` if it can). ``async_level``: also check the
    published policies an RL resume loads (``None`` for SFT); ``digest=False``: sizes only."""
    for part in parts:
        if problem := verify_sealed(run.checkpoint(step, part), digest):
            return problem
    for v in needed_weights(step, async_level) if async_level is not None else []:
        if problem := verify_sealed(run.weights_step(v), digest):
            return f"policy {v} that the resume needs: {problem}"
    return None


def verified_by_parent(run: RunDir, step: int) -> bool:
    """Whether the process that started this one checked checkpoint ``step`` of ``run`` completely."""
    return os.environ.get(VERIFIED_ENV) == str(run.checkpoint(step).resolve())


def resolve_resume(cfg: Config, run: RunDir, sft: bool = False) -> int | None:
    """The step to resume from (``ckpt.resume``), checked against what is on disk; ``None`` = fresh run.

    ``latest`` takes the newest checkpoint that verifies, logging each newer one it skips and why;
    an explicit step that does not verify is a config error naming the reason. ``sft``: an SFT run
    directory (trainer parts only, ``sft.max_steps``).
    """
    want = resume_step(cfg)
    if want is None:
        return None
    parts, max_steps = (SFT_PARTS, cfg.sft.max_steps) if sft else (PARTS, cfg.max_steps)
    have = complete_checkpoints(run, parts)
    if not have:
        raise ConfigError(
            f"invalid config:\n  ckpt.resume={cfg.ckpt.resume!r} but {run.checkpoints} holds no "
            f"complete checkpoint ({' and '.join(parts)})"
        )
    if want != -1 and want not in have:
        raise ConfigError(
            f"invalid config:\n  ckpt.resume={want} is not a complete checkpoint; available: {have}"
        )
    problems = []
    for step in reversed(have) if want == -1 else [want]:
        digest = not verified_by_parent(run, step)
        if problem := checkpoint_problem(run, step, None if sft else cfg.async_level, parts, digest):
            if want != -1:
                raise ConfigError(
                    f"invalid config:\n  ckpt.resume={want}: that checkpoint cannot be resumed from: "
                    f"{problem}; complete checkpoints: {have}"
                )
            problems.append(f"step {step}: {problem}")
            log.warning(f"skipping checkpoint step {step}: {problem}")
            continue
        if step > max_steps:
            key = "sft.max_steps" if sft else "max_steps"
            raise ConfigError(
                f"invalid config:\n  ckpt.resume={step} is past {key}={max_steps}; raise "
                f"{key} (it is the total number of steps)"
            )
        return step
    raise ConfigError(
        f"invalid config:\n  ckpt.resume={cfg.ckpt.resume!r}: no usable checkpoint in "
        f"{run.checkpoints}:\n    " + "\n    ".join(problems)
    )


def protected_weights(checkpoint_steps: list[int], async_level: int) -> set[int]:
    """Weight versions a resume from any of ``checkpoint_steps`` needs (policies N - k .. N)."""
    return {v for s in checkpoint_steps for v in needed_weights(s, async_level)}


def prune_checkpoints(run: RunDir, keep_last: int, parts: tuple[str, ...] = PARTS) -> list[int]:
    """Keep the newest ``keep_last`` complete checkpoints; delete every checkpoint (complete or not) older
    than the oldest of them. Returns the steps deleted. Never deletes the only resumable checkpoint: with
    fewer than ``keep_last`` complete ones nothing goes."""
    complete = complete_checkpoints(run, parts)
    if len(complete) < keep_last:
        return []
    oldest_kept = complete[-keep_last]
    doomed = [s for s in list_steps(run.checkpoints, require_stable=False) if s < oldest_kept]
    for s in doomed:
        for part in parts:  # markers first: a reader never takes a half-deleted part as complete
            remove_dir(run.checkpoint(s, part))
        shutil.rmtree(run.checkpoint(s), ignore_errors=True)
    return doomed


def _temporaries(parent: Path) -> list[Path]:
    """Leftovers of writes a crash interrupted: hidden ``.<name>.tmp*`` entries (see utils/atomic.py)."""
    return list(parent.glob(".*.tmp*")) if parent.is_dir() else []


def reconcile(run: RunDir, resume: int) -> list[str]:
    """Make ``run`` look as if it had stopped right after checkpoint ``resume``: remove the rollouts,
    samples, weights, checkpoints and metrics rows of later steps and every half-written temporary.
    Idempotent. Returns what it removed (for the log)."""
    removed = []
    for s in list_steps(run.rollouts, require_stable=False):
        if s >= resume:  # step `resume` is generated again
            remove_dir(run.rollout_step(s))
            removed.append(f"rollouts/step_{s}")
    for s in list_steps(run.weights, require_stable=False):
        if s > resume:
            remove_dir(run.weights_step(s))
            removed.append(f"weights/step_{s}")
    for s in list_steps(run.checkpoints, require_stable=False):
        if s > resume:
            for part in PARTS:
                remove_dir(run.checkpoint(s, part))
            shutil.rmtree(run.checkpoint(s), ignore_errors=True)
            removed.append(f"checkpoints/step_{s}")
    if run.samples.is_dir():
        for f in sorted(run.samples.glob("step_*.jsonl")):
            if f.stem.removeprefix("step_").isdigit() and int(f.stem.removeprefix("step_")) >= resume:
                f.unlink()
                removed.append(f"samples/{f.name}")
    if run.metrics.is_dir():
        for f in sorted(run.metrics.glob("*.jsonl")):
            if dropped := truncate_jsonl(f, resume):
                removed.append(f"metrics/{f.name}: {dropped} rows")
        if (run.metrics / "summary.json").exists():
            (run.metrics / "summary.json").unlink()
            removed.append("metrics/summary.json")
    if run.model.exists():  # the final policy of a run that finished: the resumed run exports its own
        remove_dir(run.model)
        removed.append("model")
    steps = [run.checkpoint(s) for s in list_steps(run.checkpoints, require_stable=False)]
    for parent in (run.root, run.rollouts, run.weights, run.checkpoints, run.metrics, run.samples, *steps):
        for p in _temporaries(parent):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(str(p.relative_to(run.root)))
    return removed
