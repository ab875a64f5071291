"""What a command needs from the machine and its config, checked before it starts anything (``asyncrl.cli``,
also for ``--cfg``, which checks what a launch would).

Each problem names the config key, its value and what would fix it, and stops the command with exit 2 and no
traceback: a directory that cannot be created or written, task data that ``asyncrl prepare`` has not written
yet, an environment that cannot be imported or whose arguments contradict each other, an RL configuration
under which no step would train anything, a process's Python environment without what the config asks of it
(:mod:`asyncrl.launcher.environments`). Torch-free and quick (no model is loaded).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from asyncrl.config import Config, ConfigError
from asyncrl.config.invariants import learning_problems
from asyncrl.config.layout import gpu_owners, missing_gpus
from asyncrl.envs import build_envs
from asyncrl.launcher.environments import environment_problems
from asyncrl.paths import data_file

# the directory each command writes, by config key
WRITES = {
    "prepare": ("data_dir",),
    "sft": ("sft.run_dir",),
    "rl": ("run_dir",),
    "reconcile": ("run_dir",),
    "train": ("run_dir",),
    "orchestrate": ("run_dir",),
    "eval": ("eval.out_dir",),
}
READS_DATA = ("sft", "rl", "orchestrate", "eval")
TRAINS_RL = ("rl", "orchestrate", "train")


def config_value(cfg: Config, key: str):
    """The value of the dotted ``key`` in ``cfg``."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def dir_problem(path: Path, create: bool = True) -> str | None:
    """Why ``path`` cannot be (created as) a writable directory, or ``None``. Tried for real (the directory
    is created, a temporary file written and removed): permission bits say little to root, and nothing about
    read-only or virtual filesystems such as /proc. ``create=False`` (``--cfg``) leaves nothing behind: a
    directory not there yet is judged by its nearest existing parent's permission bits."""
    if path.exists() and not path.is_dir():
        return "exists and is not a directory"
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file"
    if not create and parent != path:
        return (
            None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created: {parent} is not writable"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"cannot be created or written: {e.strerror or e}"
    return None


def preflight(cfg: Config, command: str, create: bool = True) -> list[str]:
    """Raise :class:`ConfigError` listing every problem ``command`` would hit with ``cfg``; else the warnings
    to show (a run that learns from no reward). ``create=False`` creates no directory."""
    problems = []
    # directories the checks made, removed again (when empty) if the launch is refused
    created: list[Path] = []
    try:
        for key in WRITES.get(command, ()):
            value = config_value(cfg, key)
            created += missing_dirs(Path(value))
            if problem := dir_problem(Path(value), create):
                problems.append(f"{key}={value}: {problem}")
        if command in ("prepare", *READS_DATA):
            problems += data_problems(cfg, command)
        warnings: list[str] = []
        if command in TRAINS_RL:
            errors, warnings = learning_problems(cfg)
            problems += errors
        if command == "rl":
            problems += layout_problems(cfg)
        problems += environment_problems(cfg, command)
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    except ConfigError:
        for d in created:  # deepest first; a directory something else wrote into stays
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return warnings


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def data_problems(cfg: Config, command: str) -> list[str]:
    """The environments must build (raises :class:`ConfigError`: unimportable type, bad or conflicting args)
    and, for a command that reads task data, ``asyncrl prepare`` must have written it."""
    envs = build_envs(cfg.env, cfg.data_dir)
    if command not in READS_DATA:
        return []
    split = cfg.eval.split if command == "eval" else "train"
    missing = [
        str(data_file(cfg.data_dir, n, split))
        for n, e in envs.items()
        if split in e.splits and not data_file(cfg.data_dir, n, split).exists()
    ]
    if not missing:
        return []
    return [
        f"data_dir={cfg.data_dir}: no task data ({', '.join(missing)}); run `asyncrl prepare` "
        "with the same env and data_dir first"
    ]


def gpu_count() -> int | None:
    """The node's GPUs as ``nvidia-smi -L`` lists them (all of them: the launcher hands each process its own
    CUDA_VISIBLE_DEVICES), or ``None`` where there is no nvidia-smi to ask."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else None


def layout_problems(cfg: Config) -> list[str]:
    """GPUs that ``asyncrl rl`` would place a process on and this node lacks (config/layout.py)."""
    if not gpu_owners(cfg):
        return []
    count = gpu_count()
    if count is None or not (missing := missing_gpus(cfg, count)):
        return []
    owners = gpu_owners(cfg)
    named = "; ".join(f"GPU {g} by {', '.join(owners[g])}" for g in missing)
    return [
        f"this node has {count} GPU(s), numbered from 0; the layout names {named}: pick a smaller layout"
    ]
