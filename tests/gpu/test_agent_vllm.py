"""On the lent GPU: the rollout-scoped endpoints on the vLLM backend. An OpenAI client's calls, streamed or
not, are recorded with the token ids and logprobs vLLM sampled; agent programs run as environments against
it. The built-in backend's tests of the same: tests/integration/test_agent_endpoint.py and
tests/integration/test_agent_env.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from asyncrl.utils.children import stop
from gpu.conftest import record, shared_common
from gpu.test_gpu import start_vllm
from helpers.agents import hostile_agent
from helpers.launch import asyncrl
from helpers.vf_support import run_env

pytestmark = pytest.mark.gpu

AGENTS = Path(__file__).resolve().parents[1] / "fixtures" / "agents"


def openai_client(base_url: str):
    """The official client; imported here, not at collection: each CPU suite worker collects this file."""
    import openai

    return openai.OpenAI(base_url=base_url, api_key="any")


TASKS = {"tasks": "toy_agents:tasks", "reward": "toy_agents:reward", "timeout_s": 120.0}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_vllm")
    asyncrl("prepare", *shared_common(root), f"model.name={root / 'model'}", check=True)
    # as docs/agents.md says
    tools = "inference.vllm.extra_args=[--enable-auto-tool-choice,--tool-call-parser,hermes]"
    proc, url = start_vllm(root / "model", root / "vllm.log", tools)
    try:
        yield {"url": url, "model": str(root / "model")}
    finally:
        stop([proc], timeout_s=60)


def test_vllm_records_an_openai_clients_calls_streamed_or_not(vllm):
    url, model = vllm["url"], vllm["model"]
    opened = httpx.post(
        f"{url}/rollouts", json={"sampling": {"temperature": 1.0}, "seed": 5}, timeout=30
    ).json()
    client = openai_client(f"{url}{opened['base_url']}")
    assert [m.id for m in client.models.list().data] == [model]
    messages = [{"role": "user", "content": "the agents task"}]
    first = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=12)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "go"},
    ]
    stream = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=12, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    calls = httpx.delete(f"{url}/rollouts/{opened['id']}", timeout=30).json()["calls"]
    record(
        "agent_vllm_calls",
        [(len(c["prompt_ids"]), len(c["completion_ids"]), c["finish_reason"]) for c in calls],
    )
    assert len(calls) == 2
    stream, later = calls[0]["prompt_ids"] + calls[0]["completion_ids"], calls[1]["prompt_ids"]
    at = next(
        (i for i, (a, b) in enumerate(zip(stream, later, strict=False)) if a != b),
        min(len(stream), len(later)),
    )
    record(
        "agent_vllm_extends",
        {"first_difference": at, "stream": stream[at - 3 : at + 3], "next": later[at - 3 : at + 3]},
    )
    # what the agent was answered, token for token
    assert calls[0]["completion_ids"] == first.choices[0].token_ids
    assert [c["reply"]["content"] for c in calls] == [first.choices[0].message.content, streamed]
    for c in calls:
        assert len(c["logprobs"]) == len(c["completion_ids"]) > 0 and all(lp <= 0 for lp in c["logprobs"])
    late = httpx.post(f"{url}{opened['base_url']}/chat/completions", json={"messages": messages}, timeout=30)
    assert late.status_code == 404 and "has ended" in late.json()["error"]["message"], late.text


def test_agent_programs_run_as_environments_against_vllm(vllm, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(AGENTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(AGENTS), os.environ.get("PYTHONPATH")]))
    )
    for args, calls in (
        ({"agent": "toy_agents:appends"}, 2),
        ({"agent": "toy_agents:rewrites"}, 2),
        ({"command": f"{sys.executable} -m toy_agents"}, 1),  # streams
    ):
        (rollouts,), counts = run_env(
            vllm, tmp_path, {**TASKS, **args}, n=4, tasks=1, env_type="agent", max_tokens=12
        )
        record(
            f"agent_vllm_{next(iter(args.values())).split()[-1]}",
            {**counts, "branches": [len(r.branches) for r in rollouts]},
        )
        assert "rollout/agent_errors" not in counts and counts["rollout/reward_errors"] == 0, counts
        assert sum(len(r.branches) - 1 for r in rollouts) == counts.get("rollout/agent_restarts", 0)
        for r in rollouts:
            assert r.info["turns"] == calls and r.branches
            trained = sum(sum(b.completion_mask) for b in r.branches)
            assert trained > 0 and all(
                len(b.completion_logprobs) == len(b.completion_ids) for b in r.branches
            )


ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
# strict, as pydantic-ai marks every tool: vLLM would constrain decoding to the schema unless told not to
TOOL = {
    "type": "function",
    "function": {"name": "add", "description": "a + b", "parameters": ADD, "strict": True},
}


def test_a_call_with_tools_is_served_and_recorded_with_vllms_tool_parser(vllm):
    """With vLLM's tool parser on, an agent's tools reach the chat template and the parser, and the call is
    recorded like any other (a random model seldom writes a well-formed call: what is checked is the path,
    not the model), sampled unconstrained although the tool is strict; a penalty is refused before vLLM sees
    it. The model's template renders no tools: vLLM renders them, the call and its result as the built-in
    sidecar and SFT do (``--chat-template`` from asyncrl.models.tool_calls), token for token."""
    from transformers import AutoTokenizer

    from asyncrl.models.tool_calls import render_chat

    url = vllm["url"]
    opened = httpx.post(f"{url}/rollouts", json={}, timeout=30).json()
    client = openai_client(f"{url}{opened['base_url']}")
    messages = [{"role": "user", "content": "add two and three"}]
    reply = client.chat.completions.create(model="m", messages=messages, tools=[TOOL], max_tokens=16)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]  # fmt: skip
    stream = client.chat.completions.create(
        model="m", messages=messages, tools=[TOOL], max_tokens=16, stream=True
    )
    list(stream)
    biased = httpx.post(
        f"{url}{opened['base_url']}/chat/completions", json={"messages": messages, "presence_penalty": 1}
    )
    # vLLM would have honoured it
    assert biased.status_code == 400 and "presence_penalty" in biased.text, biased.text
    calls = httpx.delete(f"{url}/rollouts/{opened['id']}", timeout=30).json()["calls"]
    record(
        "agent_vllm_tool_calls", [(c["finish_reason"], bool(c["reply"].get("tool_calls"))) for c in calls]
    )
    assert len(calls) == 2 and calls[0]["tools"] == [TOOL] and calls[1]["messages"][-1]["role"] == "tool"
    assert calls[0]["completion_ids"] == reply.choices[0].token_ids
    tok = AutoTokenizer.from_pretrained(vllm["model"])
    for call, sent in zip(calls, (messages[:1], messages), strict=True):
        assert (
            call["prompt_ids"]
            == tok(render_chat(tok, sent, [TOOL], True), add_special_tokens=False).input_ids
        )


def test_a_sandboxed_agent_reaches_only_its_endpoint_on_vllm(vllm, tmp_path, monkeypatch):
    """tests/integration/test_agent_sandbox.py's hostile agent (`args.sandbox`), against vLLM's sidecar: its
    call is recorded and trained on; the sidecar's port, its other routes, the internet and a host file stay
    out of reach (it would exit 1, an agent error, naming what got through)."""
    with hostile_agent(monkeypatch, vllm["url"], tmp_path) as args:
        (rollouts,), counts = run_env(
            vllm, tmp_path, args, n=2, tasks=1, env_type="agent", workers=1, max_tokens=6
        )
    record("agent_vllm_sandboxed", {**counts, "errors": [r.info["errors"] for r in rollouts]})
    assert not [k for k in counts if "agent" in k], [r.info["errors"] for r in rollouts]
    for r in rollouts:
        (branch,) = r.branches
        assert r.info["turns"] == 1 and r.reward == 1.0 and all(branch.completion_mask)
