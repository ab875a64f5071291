"""``env.<name>.type=agent``: agent programs, as written for any OpenAI server, run as environments against a
served sidecar: their calls become branches, their failures score 0 and are counted by cause."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from asyncrl.config.fields import ConfigError
from asyncrl.envs.agent import Agent
from helpers.launch import serve_sidecar
from helpers.vf_support import run_env

AGENTS = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
TASKS = {"tasks": "toy_agents:tasks", "reward": "toy_agents:reward", "timeout_s": 60.0}


@pytest.fixture(scope="module")
def sidecar(micro_model, tmp_path_factory):
    with serve_sidecar(micro_model, tmp_path_factory) as server:
        yield server


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """The agents' package, importable here and in the env workers, as a user's installed package is."""
    monkeypatch.syspath_prepend(str(AGENTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(AGENTS), os.environ.get("PYTHONPATH")]))
    )


def episodes(sidecar, tmp_path, n=2, **args):
    per_task, counts = run_env(
        sidecar, tmp_path, {**TASKS, **args}, n=n, tasks=1, env_type="agent", max_tokens=6
    )
    return per_task[0], counts


def test_an_agent_that_appends_to_its_history_trains_each_sampled_token_once(sidecar, tmp_path):
    """Two turns, appended: one stream, the user's "again" as context between two runs of trained tokens. A
    reply in which the random model sampled a role token (dropped from the reply's text, so the next prompt
    renders other tokens) starts a stream of its own instead, counted: either way every sampled token is
    trained once."""
    rollouts, counts = episodes(sidecar, tmp_path, n=4, agent="toy_agents:appends")
    assert counts["rollout/reward_errors"] == 0 and "rollout/agent_errors" not in counts, counts
    assert sum(len(r.branches) - 1 for r in rollouts) == counts.get("rollout/agent_restarts", 0)
    # every sampled token counted for staleness, under the policy the sidecar held (0: no update)
    assert counts["token_versions"] == {0: sum(r.completion_tokens for r in rollouts)}
    for r in rollouts:
        assert r.info["turns"] == 2 and r.info["stop"] == "done" and 0 <= r.reward <= 1
        assert r.info["transcript"][-1]["role"] == "assistant"
        runs = [
            sum(1 for i, m in enumerate(b.completion_mask) if m and (i == 0 or not b.completion_mask[i - 1]))
            for b in r.branches
        ]
        assert runs == ([2] if len(r.branches) == 1 else [1, 1]), runs


def test_the_same_seed_samples_the_same_episode(sidecar, tmp_path):
    a, _ = episodes(sidecar, tmp_path, n=1, agent="toy_agents:appends")
    b, _ = episodes(sidecar, tmp_path, n=1, agent="toy_agents:appends")
    assert [x.completion_ids for x in a[0].branches] == [x.completion_ids for x in b[0].branches]


def test_a_synchronous_agent_that_rewrites_its_history_gets_a_branch_per_stream_counted(sidecar, tmp_path):
    rollouts, counts = episodes(sidecar, tmp_path, agent="toy_agents:rewrites")
    assert counts["rollout/agent_restarts"] == 2, counts
    assert all(len(r.branches) == 2 and r.info["turns"] == 2 for r in rollouts)


@pytest.mark.parametrize(
    "args, cause",
    [
        ({"agent": "toy_agents:raises"}, "agent_errors"),
        ({"agent": "toy_agents:hangs", "timeout_s": 1.0}, "agent_timeouts"),
        ({"command": f"{sys.executable} -m toy_agents 3"}, "agent_errors"),  # exits 3
        ({"command": "/nonexistent/agent"}, "agent_errors"),
    ],
)
def test_an_agent_that_fails_scores_zero_is_not_trained_on_and_is_counted(sidecar, tmp_path, args, cause):
    rollouts, counts = episodes(sidecar, tmp_path, **args)
    assert counts[f"rollout/{cause}"] == 2, counts
    assert all(r.reward == 0.0 and r.branches == [] and r.info["stop"] == cause for r in rollouts)


def test_a_command_line_agent_reads_its_endpoint_from_the_environment_in_an_env_worker(sidecar, tmp_path):
    per_task, counts = run_env(
        sidecar,
        tmp_path,
        {**TASKS, "command": f"{sys.executable} -m toy_agents"},
        n=2,
        tasks=1,
        env_type="agent",
        workers=1,
    )
    assert not [k for k in counts if "agent" in k], counts
    for r in per_task[0]:
        (branch,) = r.branches
        assert all(branch.completion_mask) and r.info["turns"] == 1  # streamed, recorded all the same


def test_a_command_agents_working_directories_go_with_its_worker(sidecar, tmp_path, monkeypatch):
    """Each episode of a command runs in a fresh directory, removed once scored; what a worker holds when the
    run ends (episodes it abandons) goes when the pool closes it, what a killed worker left goes when the
    next worker makes its own, and a callable agent makes none."""
    import subprocess
    import tempfile

    from asyncrl.envs.agent import WORKDIRS_PREFIX

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # the env workers' temporary directory, forked or started afresh
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp / f"{WORKDIRS_PREFIX}{dead.stdout.strip()}-abc" / "episode").mkdir(parents=True)
    command = {**TASKS, "command": f"{sys.executable} -m toy_agents"}
    per_task, counts = run_env(sidecar, tmp_path, command, n=2, tasks=1, env_type="agent", workers=1)
    assert [r.reward for r in per_task[0]] and not [k for k in counts if "agent" in k], counts
    assert list(tmp.iterdir()) == []
    episodes(sidecar, tmp_path, n=1, agent="toy_agents:appends")
    assert list(tmp.iterdir()) == []


def test_a_command_that_writes_without_end_costs_the_worker_only_its_output_tail(sidecar, tmp_path):
    """256 MiB on stdout, then the answer: the reward reads the end of it (kept: the last 64 KiB), and the
    process that ran the episode held no more than that (its peak memory grows by far less than what was
    written)."""
    import resource

    write = "import sys; [sys.stdout.write('x' * 2**20) for _ in range(256)]; print('cba')"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    per_task, counts = run_env(
        sidecar,
        tmp_path,
        {**TASKS, "command": f'{sys.executable} -c "{write}"'},
        n=1,
        tasks=1,
        env_type="agent",
    )
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert not [k for k in counts if "agent" in k] and per_task[0][0].reward == 1.0, counts
    assert grown_mb < 64, f"the episode's process grew by {grown_mb:.0f} MiB"


def test_an_agent_environment_needs_one_program_a_task_list_and_a_reward(tmp_path):
    with pytest.raises(ConfigError, match="give exactly one of them"):
        Agent("a", tmp_path, {**TASKS, "agent": "toy_agents:appends", "command": "x"})
    with pytest.raises(ConfigError, match="env.a.args.reward"):
        Agent("a", tmp_path, {"agent": "toy_agents:appends", "tasks": "toy_agents:tasks"})
    with pytest.raises(ConfigError, match="env.a.args.tasks='nope:tasks'.*cannot import nope"):
        Agent("a", tmp_path, {**TASKS, "agent": "toy_agents:appends", "tasks": "nope:tasks"}).generate(
            "train", 0
        )
