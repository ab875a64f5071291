"""The sidecar's rollout-scoped endpoints: an OpenAI client's calls, recorded in token ids, on the built-in
backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from fastapi.testclient import TestClient

from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine import HFEngine
from asyncrl.inference.builtin.server import build_app

if TYPE_CHECKING:
    import openai


@pytest.fixture(scope="module")
def app(micro_model):
    engine = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    with TestClient(build_app(engine, InferenceConfig()), client=("127.0.0.1", 5000)) as client:
        yield client


def agent(app: TestClient, base_url: str) -> openai.OpenAI:
    """The official client, as an agent builds it, over the in-process app."""
    import openai  # here, not at collection: each of the suite's workers collects every file

    return openai.OpenAI(base_url=f"http://testserver{base_url}", api_key="any", http_client=app)


def test_an_agents_calls_are_recorded_in_order_with_their_tokens(app):
    opened = app.post("/rollouts", json={}).json()
    client = agent(app, opened["base_url"])
    assert [m.id for m in client.models.list().data]  # the policy, whatever the agent calls it
    messages = [{"role": "user", "content": "abc"}]
    first = client.chat.completions.create(
        model="gpt-4o", messages=messages, max_tokens=5, temperature=1.0, seed=1
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "d"},
    ]
    chunks = list(
        client.chat.completions.create(model="x", messages=messages, max_tokens=4, stream=True, seed=2)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = app.delete(f"/rollouts/{opened['id']}").json()["calls"]
    assert len(calls) == 2
    for call, reply in zip(calls, (first.choices[0].message.content, streamed), strict=True):
        assert call["reply"]["content"] == reply
        assert len(call["completion_ids"]) == len(call["logprobs"]) > 0 and call["prompt_ids"]
        assert all(lp <= 0 for lp in call["logprobs"]) and call["version"] == 0
    assert calls[1]["messages"] == messages
    # the same request on the plain route samples the same tokens: the endpoint records, it does not change
    served = app.get("/v1/models").json()["data"][0]["id"]
    plain = app.post(
        "/v1/chat/completions",
        json={
            "model": served,
            "messages": messages[:1],
            "max_tokens": 5,
            "temperature": 1.0,
            "seed": 1,
            "return_token_ids": True,
            "logprobs": True,
        },
    ).json()
    assert plain["choices"][0]["token_ids"] == calls[0]["completion_ids"]
    assert plain["prompt_token_ids"] == calls[0]["prompt_ids"]


def test_a_call_to_an_ended_or_unknown_rollout_is_refused_by_name(app):
    opened = app.post("/rollouts", json={"ttl_s": 60}).json()
    app.delete(f"/rollouts/{opened['id']}")
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    late = app.post(f"{opened['base_url']}/chat/completions", json=body)
    assert late.status_code == 404 and "has ended" in late.json()["error"]["message"]
    unknown = app.post("/rollouts/nope/v1/chat/completions", json=body)
    assert unknown.status_code == 404 and "no rollout 'nope'" in unknown.json()["error"]["message"]
    assert app.delete("/rollouts/nope").status_code == 404


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("chat/completions", b"not json", 400),
        ("chat/completions", {"messages": "hi"}, 400),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 2}, 400),
        ("completions", {"prompt": "a"}, 404),
    ],
)
def test_a_malformed_call_gets_a_4xx_and_records_nothing(app, path, body, status):
    opened = app.post("/rollouts", json={}).json()
    url = f"{opened['base_url']}/{path}"
    r = app.post(url, content=body) if isinstance(body, bytes) else app.post(url, json=body)
    assert r.status_code in (status, 422) and "error" in r.json(), r.text
    assert app.delete(f"/rollouts/{opened['id']}").json()["calls"] == []


def test_a_call_that_would_sample_another_distribution_is_refused_on_either_backend(app):
    """Penalties, biases and constrained decoding change what is sampled: the recorded logprobs would not be
    the policy's, which the trainer recomputes. The rollout endpoint refuses them by name, before the backend
    (vLLM would honour them); at their neutral values they pass."""
    opened = app.post("/rollouts", json={"sampling": {"max_tokens": 2}}).json()
    url, messages = f"{opened['base_url']}/chat/completions", [{"role": "user", "content": "a"}]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    refused = [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"response_format": schema}, "response_format"),
        ({"logit_bias": {"3": 5}, "min_tokens": 2}, "logit_bias, min_tokens"),
    ]
    for extra, named in refused:
        r = app.post(url, json={"messages": messages, **extra})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(named), r.text
        assert "the policy's own distribution" in r.json()["error"]["message"]
    neutral = {"frequency_penalty": 0, "response_format": {"type": "text"}, "logit_bias": {}}
    assert app.post(url, json={"messages": messages, **neutral}).status_code == 200
    assert len(app.delete(f"/rollouts/{opened['id']}").json()["calls"]) == 1


def test_opening_a_rollout_is_an_admin_route(micro_model):
    engine = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    remote = TestClient(build_app(engine, InferenceConfig(admin_token="s3cret")), client=("10.0.0.9", 5000))
    assert remote.post("/rollouts", json={}).status_code == 403
    assert remote.post("/rollouts", json={}, headers={"Authorization": "Bearer s3cret"}).status_code == 200


ADD = {
    "type": "function",
    "function": {"name": "add", "description": "a+b", "parameters": {"type": "object"}},
}


def test_an_agents_tools_and_tool_results_reach_the_template_and_the_record(tmp_path):
    """The built-in backend renders tools in Hermes' format for a template without tools of its own (the
    micro models'), and a conversation holding a call and its result; both calls are recorded with their
    tools."""
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from helpers.launch import MICRO_MODEL

    init = compose_config(
        [*MICRO_MODEL, "model.init.charset=ascii_printable", "model.init.max_position_embeddings=512"]
    )
    build_tiny_model(init.model.init, tmp_path / "model", seed=0)
    engine = HFEngine(ModelConfig(name=str(tmp_path / "model")), InferenceConfig(), seed=0)
    with TestClient(build_app(engine, InferenceConfig()), client=("127.0.0.1", 5000)) as app:
        opened = app.post("/rollouts", json={"sampling": {"max_tokens": 6}}).json()
        client = agent(app, opened["base_url"])
        messages = [{"role": "user", "content": "add 2 and 3"}]
        client.chat.completions.create(model="m", messages=messages, tools=[ADD], tool_choice="auto")
        call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c1", "content": "5"}]  # fmt: skip
        list(client.chat.completions.create(model="m", messages=messages, tools=[ADD], stream=True))
        required = app.post(
            f"{opened['base_url']}/chat/completions",
            json={"messages": messages, "tools": [ADD], "tool_choice": "required"},
        )
        calls = app.delete(f"/rollouts/{opened['id']}").json()["calls"]
    assert required.status_code == 400 and "tool_choice" in required.json()["error"]["message"]
    assert len(calls) == 2 and all(c["tools"] == [ADD] for c in calls)
    first, second = (engine.tokenizer.decode(c["prompt_ids"]) for c in calls)
    assert '<tools>[{"name":"add"' in first and first.endswith("add 2 and 3<|end|><|assistant|>")
    assert '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>' in second
    assert "<tool_response>5</tool_response>" in second
    assert all(len(c["completion_ids"]) <= 6 for c in calls)  # the rollout's max_tokens bounds every call
