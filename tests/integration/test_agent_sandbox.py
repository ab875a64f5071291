"""``env.<name>.args.sandbox=true``: an untrusted command-line agent runs in the code sandbox's bubble, where
the one way out is its rollout's ``/v1`` endpoint; it trains as any agent does, and what it tries beyond that
fails."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from asyncrl.config.fields import ConfigError
from asyncrl.envs.agent import Agent
from asyncrl.sandbox import SandboxUnavailable
from asyncrl.sandbox.isolation import bwrap_binary
from helpers.agents import hostile_agent
from helpers.launch import serve_sidecar
from helpers.vf_support import run_env


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


@pytest.fixture
def args(monkeypatch, sidecar, tmp_path):
    with hostile_agent(monkeypatch, sidecar["url"], tmp_path) as args:
        yield args


def test_a_sandboxed_agent_trains_through_its_endpoint_and_reaches_nothing_else(sidecar, tmp_path, args):
    """The agent (in an env worker) tries the sidecar's port, its admin routes and other rollouts through the
    endpoint (dot segments too), the internet and a host file, then makes its call: the call is recorded and
    trained on, the reward reads the file it wrote, and nothing else got through (it would exit 1, an
    error)."""
    per_task, counts = run_env(
        sidecar, tmp_path, args, n=2, tasks=1, env_type="agent", workers=1, max_tokens=6
    )
    rollouts = per_task[0]
    assert not [k for k in counts if "agent" in k], [r.info["errors"] for r in rollouts]
    for r in rollouts:
        (branch,) = r.branches
        assert r.info["turns"] == 1 and r.info["stop"] == "done" and all(branch.completion_mask)
        assert r.reward == 1.0  # the reply it printed is in the answer.txt it wrote in its working directory


def test_a_sandboxed_agent_past_its_deadline_is_killed_with_everything_it_started(sidecar, tmp_path, args):
    marker = f"asyncrl-test-{uuid.uuid4().hex}"
    script = Path(args["sandbox_paths"][0]) / "forks.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'])\n"
        "time.sleep(600)\n"
    )
    script.chmod(0o644)
    hangs = {**args, "command": f"python3 {script} {marker}", "timeout_s": 3.0}
    per_task, counts = run_env(sidecar, tmp_path, hangs, n=1, tasks=1, env_type="agent")
    assert counts["rollout/agent_timeouts"] == 1, counts
    assert per_task[0][0].branches == [] and per_task[0][0].reward == 0.0
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert not left, f"processes of the killed sandbox are still running: {left}"


def test_a_sandboxed_agent_that_cannot_start_scores_zero(sidecar, tmp_path, args):
    missing = {**args, "command": "/nonexistent/agent"}
    per_task, counts = run_env(sidecar, tmp_path, missing, n=1, tasks=1, env_type="agent")
    assert counts["rollout/agent_errors"] == 1, counts
    assert "exited 127" in per_task[0][0].info["errors"][0]


def test_the_sandbox_runs_a_command_from_paths_it_can_read(tmp_path, args):
    sandboxed = {k: v for k, v in args.items() if k not in ("command", "sandbox_paths")}
    with pytest.raises(ConfigError, match="sandbox=true runs a command line"):
        Agent("a", tmp_path, {**sandboxed, "agent": "toy_agents:appends"})
    with pytest.raises(ConfigError, match="sandbox_paths: /nonexistent/agents does not exist"):
        Agent(
            "a", tmp_path, {**sandboxed, "command": "python3 a.py", "sandbox_paths": ["/nonexistent/agents"]}
        )
    with pytest.raises(ConfigError, match="sandbox_paths: agents is not an absolute path"):
        Agent("a", tmp_path, {**sandboxed, "command": "python3 a.py", "sandbox_paths": ["agents"]})
