"""Atomic hand-offs between processes: write under a temporary name, rename, then write the marker.

A reader treats a directory as complete only once its ``STABLE`` marker exists, so it never sees a
half-written file: the rename makes the content appear at once, and the marker comes after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from asyncrl.paths import STABLE


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes ``final`` and gets its STABLE marker last.

    An existing ``final`` is replaced (a resumed run re-publishes the steps after its checkpoint).
    On error the temporary directory is removed and ``final`` is left untouched.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    (final / STABLE).touch()


def remove_dir(path: Path) -> None:
    """Remove a hand-off directory marker-first, so a reader never takes a half-deleted one as complete."""
    with contextlib.suppress(FileNotFoundError):
        (path / STABLE).unlink()
    shutil.rmtree(path, ignore_errors=True)


def wait_until(predicate: Callable[[], Any], timeout_s: float, poll_s: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something truthy; raise ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
