"""Atomic hand-offs between processes: write under a temporary name, rename, then write the marker.

A reader treats a directory as complete only once its ``STABLE`` marker exists, so it never sees a
half-written file: the rename makes the content appear at once, and the marker comes after it.

The marker is a manifest (:func:`seal`): every file's size, and its sha256 for checkpoints. A directory
that a crash, a full disk or a careless copy left short or altered *after* its marker was written fails
:func:`verify_sealed`, so a resume skips it instead of failing deep inside torch or safetensors. An empty
marker carries no manifest and verifies as complete (there is nothing to check).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asyncrl.paths import STABLE


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# files are born 0600 in some writers (safetensors); a hand-off gets the modes a plain `open` would give
_FILE_MODE = 0o666 & ~_umask()
_DIR_MODE = 0o777 & ~_umask()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != STABLE)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def seal(path: Path, digest: bool = False) -> None:
    """Make ``path``'s files world-readable as the umask allows, then write its ``STABLE`` marker last:
    a manifest of every file's size (and sha256 with ``digest``, for checkpoints: read once, at resume)."""
    os.chmod(path, _DIR_MODE)
    files = {}
    for f in _files(path):
        os.chmod(f, _FILE_MODE)
        files[f.relative_to(path).as_posix()] = {
            "size": f.stat().st_size,
            **({"sha256": _sha256(f)} if digest else {}),
        }
    for d in (p for p in path.rglob("*") if p.is_dir()):
        os.chmod(d, _DIR_MODE)
    tmp = path / f".{STABLE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / STABLE)


def verify_sealed(path: Path, digest: bool = True) -> str | None:
    """Why ``path`` is not a complete hand-off (``None`` if it is): no marker, or a file missing, of the
    wrong size or (where recorded, and with ``digest``) the wrong sha256."""
    marker = path / STABLE
    try:
        text = marker.read_text()
    except FileNotFoundError:
        return f"{path}: no {STABLE} marker (not completely written)"
    if not text.strip():
        return None  # an empty marker: complete, no manifest to check
    try:
        files = json.loads(text)["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"{marker}: unreadable manifest"
    for rel, want in files.items():
        f = path / rel
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != want["size"]:
            return f"{f}: {f.stat().st_size} bytes, {want['size']} when written (truncated or altered)"
        if digest and "sha256" in want and _sha256(f) != want["sha256"]:
            return f"{f}: sha256 differs from when it was written (corrupt)"
    return None


@contextlib.contextmanager
def atomic_dir(final: Path, digest: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes ``final`` and gets its STABLE marker last
    (:func:`seal`; ``digest``: record sha256 sums too).

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
        remove_dir(final)
    os.replace(tmp, final)
    seal(final, digest)


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
