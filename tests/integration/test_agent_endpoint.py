"""The sidecar's rollout-scoped endpoints: an OpenAI client's calls, recorded in token ids, on the built-in backend."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine import HFEngine
from asyncrl.inference.builtin.server import build_app


@pytest.fixture(scope="module")
def app(micro_model):
    engine = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    with TestClient(build_app(engine, InferenceConfig()), client=("127.0.0.1", 5000)) as client:
        yield client


def agent(app: TestClient, base_url: str) -> openai.OpenAI:
    """The official client, as an agent builds it, over the in-process app."""
    return openai.OpenAI(base_url=f"http://testserver{base_url}", api_key="any", http_client=app)


def test_an_agents_calls_are_recorded_in_order_with_their_tokens(app):
    opened = app.post("/rollouts", json={}).json()
    client = agent(app, opened["base_url"])
    assert [m.id for m in client.models.list().data]  # the policy, whatever the agent calls it
    messages = [{"role": "user", "content": "abc"}]
    first = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=5, temperature=1.0, seed=1)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "d"}]
    chunks = list(client.chat.completions.create(model="x", messages=messages, max_tokens=4, stream=True, seed=2))
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
    plain = app.post("/v1/chat/completions", json={"model": served, "messages": messages[:1], "max_tokens": 5,
                     "temperature": 1.0, "seed": 1, "return_token_ids": True, "logprobs": True}).json()  # fmt: skip
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


def test_opening_a_rollout_is_an_admin_route(micro_model):
    engine = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    remote = TestClient(build_app(engine, InferenceConfig(admin_token="s3cret")), client=("10.0.0.9", 5000))
    assert remote.post("/rollouts", json={}).status_code == 403
    assert remote.post("/rollouts", json={}, headers={"Authorization": "Bearer s3cret"}).status_code == 200
