"""``env.<name>.args.sandbox=true``: an untrusted command-line agent runs in the code sandbox's bubble, where the
one way out is its rollout's ``/v1`` endpoint; it trains as any agent does, and what it tries beyond that fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from asyncrl.config.fields import ConfigError
from asyncrl.envs.agent import Agent
from asyncrl.sandbox import SandboxUnavailable
from asyncrl.sandbox.isolation import bwrap_binary
from helpers.launch import serve_sidecar
from helpers.vf_support import run_env

AGENTS = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
TASKS = {
    "tasks": "toy_agents:sandbox_tasks",
    "reward": "toy_agents:wrote_its_reply",
    "timeout_s": 60.0,
    "sandbox": True,
}


def _bwrap() -> bool:
    try:
        bwrap_binary()
        return True
    except SandboxUnavailable:
        return False


pytestmark = pytest.mark.skipif(not _bwrap(), reason="no bubblewrap here")


@pytest.fixture(scope="module")
def sidecar(micro_model, tmp_path_factory):
    with serve_sidecar(micro_model, tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="module")
def shared():
    """The agent's code where the sandbox's user can read it (nobody, when the tests run as root: a clone in a
    private directory is out of its reach), as a user's agent directory would be."""
    where = Path(tempfile.mkdtemp(prefix="asyncrl-test-agent-"))
    where.chmod(0o755)
    shutil.copy(AGENTS / "sandboxed_agent.py", where)
    (where / "sandboxed_agent.py").chmod(0o644)
    yield where
    shutil.rmtree(where)


@pytest.fixture(autouse=True)
def importable(monkeypatch, sidecar, tmp_path):
    monkeypatch.syspath_prepend(str(AGENTS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(AGENTS), os.environ.get("PYTHONPATH")])))
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's")
    monkeypatch.setenv("TEST_SIDECAR_URL", sidecar["url"])
    monkeypatch.setenv("TEST_HOST_FILE", str(secret))


def test_a_sandboxed_agent_trains_through_its_endpoint_and_reaches_nothing_else(sidecar, tmp_path, shared):
    """The agent (in an env worker) tries the sidecar's port, its admin routes and other rollouts through the
    endpoint (dot segments too), the internet and a host file, then makes its call: the call is recorded and
    trained on, the reward reads the file it wrote, and nothing else got through (it would exit 1, an error)."""
    args = {**TASKS, "command": f"python3 {shared}/sandboxed_agent.py", "sandbox_paths": [str(shared)]}
    per_task, counts = run_env(sidecar, tmp_path, args, n=2, tasks=1, env_type="agent", workers=1, max_tokens=6)
    rollouts = per_task[0]
    assert not [k for k in counts if "agent" in k], [r.info["errors"] for r in rollouts]
    for r in rollouts:
        (branch,) = r.branches
        assert r.info["turns"] == 1 and r.info["stop"] == "done" and all(branch.completion_mask)
        assert r.reward == 1.0  # the reply it printed is in the answer.txt it wrote in its working directory


def test_a_sandboxed_agent_past_its_deadline_is_killed_with_everything_it_started(sidecar, tmp_path, shared):
    marker = f"asyncrl-test-{uuid.uuid4().hex}"
    script = shared / "forks.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'])\n"
        "time.sleep(600)\n"
    )
    script.chmod(0o644)
    args = {**TASKS, "command": f"python3 {script} {marker}", "sandbox_paths": [str(shared)], "timeout_s": 3.0}
    per_task, counts = run_env(sidecar, tmp_path, args, n=1, tasks=1, env_type="agent")
    assert counts["rollout/agent_timeouts"] == 1, counts
    assert per_task[0][0].branches == [] and per_task[0][0].reward == 0.0
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert not left, f"processes of the killed sandbox are still running: {left}"


def test_a_sandboxed_agent_that_cannot_start_scores_zero(sidecar, tmp_path):
    per_task, counts = run_env(
        sidecar, tmp_path, {**TASKS, "command": "/nonexistent/agent"}, n=1, tasks=1, env_type="agent"
    )
    assert counts["rollout/agent_errors"] == 1, counts
    assert "exited 127" in per_task[0][0].info["errors"][0]


def test_the_sandbox_runs_a_command_from_paths_it_can_read(tmp_path):
    with pytest.raises(ConfigError, match="sandbox=true runs a command line"):
        Agent("a", tmp_path, {**TASKS, "agent": "toy_agents:appends"})
    with pytest.raises(ConfigError, match="sandbox_paths: /nonexistent/agents does not exist"):
        Agent("a", tmp_path, {**TASKS, "command": "python3 agent.py", "sandbox_paths": ["/nonexistent/agents"]})
    with pytest.raises(ConfigError, match="sandbox_paths: agents is not an absolute path"):
        Agent("a", tmp_path, {**TASKS, "command": "python3 agent.py", "sandbox_paths": ["agents"]})
