"""Temporary directories named by the process that made them.

A process killed by a signal runs neither ``atexit`` nor ``finally``, and a worker the orchestrator kills at
its deadline or at the run's end is one: what it had made under ``/tmp`` would stay. A directory named
``<prefix><pid>-<random>`` says whose it is, so the next process that makes one of that prefix removes those
whose maker is gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def process_tempdir(prefix: str) -> Path:
    """A new directory ``<tmp>/<prefix><pid>-<random>``, after removing the ones of ``prefix`` whose process
    is gone."""
    remove_stale(prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def remove_stale(prefix: str, parent: str | None = None) -> list[Path]:
    """Remove this user's directories of ``prefix`` under ``parent`` (default: the temporary directory) whose
    process has ended; returns them."""
    removed = []
    for path in Path(parent or tempfile.gettempdir()).glob(f"{prefix}*"):
        pid = path.name.removeprefix(prefix).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and _mine(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _mine(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.geteuid()
    except OSError:
        return False
