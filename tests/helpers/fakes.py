"""Stand-ins for what the test machine lacks: a usable bwrap, the dataset hub."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import types
from pathlib import Path


@contextlib.contextmanager
def unusable_bwrap():
    """The path of a bwrap that cannot make namespaces (as in a default Docker container), in a
    world-readable directory so that the sandbox user (nobody, when the tests run as root) can run it."""
    shared = Path(tempfile.mkdtemp(prefix="asyncrl-fake-bwrap-"))
    try:
        shared.chmod(0o755)
        fake = shared / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        yield str(fake)
    finally:
        shutil.rmtree(shared)


def offline_hub(monkeypatch, rows_by_dataset: dict[str, list[dict]]) -> list[tuple[str, dict]]:
    """Stand in for the hub (unreachable here): ``datasets.load_dataset(path, **kwargs)`` returns the rows
    given for ``path``, as a real one would; the calls made are recorded in the returned list."""
    calls: list[tuple[str, dict]] = []

    def load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return rows_by_dataset[path]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls
