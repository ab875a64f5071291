"""What a command needs from the machine, checked before it starts anything (``asyncrl.cli``).

Each problem names the config key, its value and what would fix it, and stops the command with exit 2
and no traceback: a directory that cannot be created or written, task data that ``asyncrl prepare`` has
not written yet, an environment that cannot be imported or whose arguments contradict each other.
Torch-free and quick (no model is loaded).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from asyncrl.config.fields import ConfigError
from asyncrl.config.root import Config

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


def _get(cfg: Config, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be (created as) a writable directory, or ``None``. Tried for real (the directory is
    created, a temporary file written and removed): permission bits say little to root, and nothing about
    read-only or virtual filesystems such as /proc."""
    if path.exists() and not path.is_dir():
        return "exists and is not a directory"
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"cannot be created or written: {e.strerror or e}"
    return None


def preflight(cfg: Config, command: str) -> None:
    """Raise :class:`ConfigError` listing every problem ``command`` would hit with ``cfg``."""
    from asyncrl.envs import build_envs
    from asyncrl.paths import data_file

    problems = []
    for key in WRITES.get(command, ()):
        value = _get(cfg, key)
        if problem := dir_problem(Path(value)):
            problems.append(f"{key}={value}: {problem}")
    if command in ("prepare", *READS_DATA):
        envs = build_envs(cfg.env, cfg.data_dir)  # raises ConfigError: unimportable type, bad or conflicting args
        if command in READS_DATA:
            split = cfg.eval.split if command == "eval" else "train"
            missing = [
                str(data_file(cfg.data_dir, n, split))
                for n, e in envs.items()
                if split in e.splits and not data_file(cfg.data_dir, n, split).exists()
            ]
            if missing:
                problems.append(
                    f"data_dir={cfg.data_dir}: no task data ({', '.join(missing)}); run `asyncrl prepare` "
                    "with the same env and data_dir first"
                )
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
