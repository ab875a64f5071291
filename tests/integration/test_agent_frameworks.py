"""Agents written with real frameworks, unmodified but for their base URL (environments/tool_agents: the
OpenAI Agents SDK and pydantic-ai, each with one tool), trained as `type: agent` environments on the CPU
default: the agent's loop completes through asyncrl's sidecar (its tool's schema in the prompt), its calls
become samples, and the trainer steps on them."""

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


def test_a_demonstration_renders_what_the_framework_sends_and_trains_the_call(micro_model, tmp_path_factory):
    """`args.demonstration` of each shipped agent: its prompt and tools render, token for token, as the
    sidecar rendered the framework's own first request, so SFT warms the model up on what the agent will
    send; the trained tokens are the call, in the format the sidecar reads back, and the answer."""
    import asyncio

    import httpx
    from transformers import AutoTokenizer

    from asyncrl.config.compose import compose_config
    from asyncrl.envs.agent import Agent
    from asyncrl.models.hf import build_tiny_model, render_conversation
    from asyncrl.rollouts.calls import recorded_rollout
    from helpers.launch import serve_sidecar

    for package in ("agents", "pydantic_ai"):
        require(
            None if importlib.util.find_spec(package) else f"{package} is not installed",
            "the agent frameworks",
        )
    root = tmp_path_factory.mktemp("printable")
    build_tiny_model(compose_config(PRINTABLE).model.init, root / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    task = {"id": "train-0", "prompt": "What is 2 plus 3?", "a": 2, "b": 3, "answer": 5}

    async def first_request(url: str, model: str, agent) -> dict:
        async with httpx.AsyncClient() as http:
            async with recorded_rollout(http, url, model, 60, {"max_tokens": 4}, 1) as (endpoint, recorded):
                await agent(task, endpoint)
        return recorded.calls[0]

    with serve_sidecar(root / "model", tmp_path_factory, *PRINTABLE[len(MICRO_MODEL) :]) as sidecar:
        for framework in ("openai_agents", "pydantic_ai"):
            spec = {f"{k}": f"asyncrl_tool_agents.with_{framework}:{k}" for k in ("agent", "demonstration")}
            env = Agent(
                "adder",
                tmp_path_factory.getbasetemp(),
                {**spec, "tasks": "asyncrl_tool_agents:tasks", "reward": "asyncrl_tool_agents:reward"},
            )
            sent = asyncio.run(first_request(sidecar["url"], sidecar["model"], env._named("agent")))
            prompt, completion, mask = render_conversation(
                tokenizer, env.prompt(task), env.demonstration(task), tools=env.tools(task)
            )
            assert prompt == sent["prompt_ids"], (
                framework,
                tokenizer.decode(prompt),
                tokenizer.decode(sent["prompt_ids"]),
            )
            trained = tokenizer.decode([t for t, m in zip(completion, mask, strict=True) if m])
            assert (
                trained == '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call><|end|>5<|end|>'
            )
