"""Session fixtures built once per test run, also when pytest-xdist spreads the suite over worker processes.

A session fixture runs once per worker; the ones that cost whole processes (the SFT-warmed setup, the
straight RL run) are built by the first worker that asks, under a file lock in the run's common temp
directory, and read by the others. They are read-only to the tests that share them, as any session fixture
is.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

BUILT = ".built"  # written last: a directory without it is an interrupted build, made again


def common_temp(tmp_path_factory) -> Path:
    """The temp directory of this whole run: pytest's base temp, or its parent under xdist (whose workers
    each get ``<run temp>/popen-gwN``)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if base.name.startswith("popen-gw") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """``build(dir)`` once for this run (every xdist worker gets the same ``dir``); returns ``dir``."""
    root = common_temp(tmp_path_factory)
    out = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (out / BUILT).exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            build(out)
            (out / BUILT).touch()
    return out
