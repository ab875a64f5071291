"""Agents written with real frameworks, unmodified but for their base URL (environments/tool_agents: the OpenAI
Agents SDK and pydantic-ai, each with one tool), trained as `type: agent` environments on the CPU default: the
agent's loop completes through asyncrl's sidecar (its tool's schema in the prompt), its calls become samples, and
the trainer steps on them."""

from __future__ import annotations

import importlib.util

import pytest

from helpers.launch import MICRO_MODEL, asyncrl
from helpers.metrics import read_jsonl
from helpers.required import require

# the micro model, with the characters and the context a tool's JSON schema in the prompt needs
PRINTABLE = [*MICRO_MODEL, "model.init.charset=ascii_printable", "model.init.max_position_embeddings=1024"]


@pytest.mark.parametrize("framework, package", [("openai_agents", "agents"), ("pydantic_ai", "pydantic_ai")])
def test_a_framework_agent_with_a_tool_trains_end_to_end(tmp_path, framework, package):
    missing = None if importlib.util.find_spec(package) else f"{package} is not installed (asyncrl[agents])"
    require(missing, f"the {framework} agent framework")
    env, data, run = [f"env=[adder_{framework}]"], tmp_path / "data", tmp_path / "rl"
    common = [*env, f"data_dir={data}", *PRINTABLE, f"model.name={tmp_path / 'model'}", "seq_len=1024"]
    asyncrl("prepare", *common, check=True)
    args = [f"run_dir={run}", "max_steps=1", "orchestrator.prompts_per_step=2", "orchestrator.group_size=2",
            "orchestrator.max_tokens=12", "launcher.progress=false"]  # fmt: skip
    proc = asyncrl("rl", *common, *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (orch,) = read_jsonl(run / "metrics" / "orchestrator.jsonl")
    assert not [k for k in orch if k.startswith("rollout/agent_") and k != "rollout/agent_restarts"], orch
    assert orch["rollout/reward_errors"] == 0, orch
    samples = (run / "samples").rglob("*.jsonl")
    episodes = [line for path in samples for line in path.read_text().splitlines()]
    assert len(episodes) == 4 and all('"turns": ' in e for e in episodes), episodes[:1]
    assert [r["step"] for r in read_jsonl(run / "metrics" / "trainer.jsonl")] == [0]
