"""The fixture agents (tests/fixtures/agents) as the tests of both sidecars run them."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

AGENTS = Path(__file__).resolve().parents[1] / "fixtures" / "agents"


def importable(monkeypatch) -> None:
    """The agents' package, importable here and in the env workers, as a user's installed package is."""
    monkeypatch.syspath_prepend(str(AGENTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(AGENTS), os.environ.get("PYTHONPATH")]))
    )


@contextlib.contextmanager
def hostile_agent(monkeypatch, sidecar_url: str, tmp_path: Path) -> Iterator[dict]:
    """``env.<name>.args`` of ``sandboxed_agent.py`` in a sandbox, told what to try: the sidecar at
    ``sidecar_url`` and a host file. Its code is copied where the sandbox's user can read it (nobody, when
    the tests run as root: a clone in a private directory is out of its reach), as a user's agent directory
    would be."""
    importable(monkeypatch)
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's")
    monkeypatch.setenv("TEST_SIDECAR_URL", sidecar_url)
    monkeypatch.setenv("TEST_HOST_FILE", str(secret))
    shared = Path(tempfile.mkdtemp(prefix="asyncrl-test-agent-"))
    try:
        shared.chmod(0o755)
        shutil.copy(AGENTS / "sandboxed_agent.py", shared)
        (shared / "sandboxed_agent.py").chmod(0o644)
        yield {
            "tasks": "toy_agents:sandbox_tasks",
            "reward": "toy_agents:wrote_its_reply",
            "timeout_s": 120.0,
            "command": f"python3 {shared}/sandboxed_agent.py",
            "sandbox": True,
            "sandbox_paths": [str(shared)],
        }
    finally:
        shutil.rmtree(shared)
