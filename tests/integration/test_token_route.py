"""What verifiers and OpenAI clients need from the sidecar: vLLM's token route ``/inference/v1/generate``,
``max_model_len`` in ``/v1/models``, and ``stream=true`` (server-sent events) read by the official client."""

from __future__ import annotations

import httpx
import pytest

from helpers.inputs import staggered_sampling


@pytest.fixture
def sidecar(micro_sidecar):
    return micro_sidecar


def generate(url: str, token_ids, **sampling) -> httpx.Response:
    return httpx.post(
        f"{url}/inference/v1/generate",
        json={"token_ids": token_ids, "sampling_params": sampling},
        timeout=60,
    )


def chat_prompt_ids(url: str, text: str) -> list[int]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "return_token_ids": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["prompt_token_ids"]


def test_models_list_the_context_length(sidecar):
    card = httpx.get(f"{sidecar['url']}/v1/models").json()["data"][0]
    assert card["id"] == sidecar["model"] and card["max_model_len"] == 128  # MICRO_MODEL's positions


def test_generate_answers_ids_logprobs_and_finish_reasons_as_the_chat_route_samples(sidecar):
    url = sidecar["url"]
    prompt = chat_prompt_ids(url, "abc")
    r = generate(url, prompt, n=3, max_tokens=6, temperature=1.0, seed=11, logprobs=1)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["prompt_token_ids"] == prompt and data["request_id"]
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    for c in data["choices"]:
        content = c["logprobs"]["content"]
        # what renderers checks
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in c["token_ids"]]
        assert all(e["logprob"] <= 0 for e in content) and len(c["token_ids"]) <= 6
        assert c["finish_reason"] in ("stop", "length")
        assert c["finish_reason"] == "length" or len(c["token_ids"]) < 6
    # the same ids and seed through the chat route sample the same tokens with the same logprobs: one engine
    body = {"messages": [{"role": "user", "content": "abc"}], "n": 3, "max_tokens": 6, "seed": 11}
    chat = httpx.post(
        f"{url}/v1/chat/completions", json={**body, "logprobs": True, "return_token_ids": True}
    ).json()
    for g, c in zip(data["choices"], chat["choices"], strict=True):
        assert g["token_ids"] == c["token_ids"]
        assert [e["logprob"] for e in g["logprobs"]["content"]] == [
            e["logprob"] for e in c["logprobs"]["content"]
        ]
    # without logprobs: null, as vLLM answers
    assert generate(url, prompt, max_tokens=2, seed=1).json()["choices"][0]["logprobs"] is None


def test_samples_that_stop_on_different_steps_all_come_back(sidecar):
    url = sidecar["url"]
    r = generate(url, chat_prompt_ids(url, "abc"), **staggered_sampling(sidecar["model"]))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(8))
    assert len({len(c["token_ids"]) for c in choices}) > 1  # they did stop on different steps


def test_generate_stops_on_stop_token_ids_and_counts_max_tokens(sidecar):
    url = sidecar["url"]
    prompt = chat_prompt_ids(url, "hello")
    free = generate(url, prompt, max_tokens=8, temperature=0, logprobs=0).json()["choices"][0]
    first = free["token_ids"][0]
    stopped = generate(url, prompt, max_tokens=8, temperature=0, stop_token_ids=[first]).json()["choices"][0]
    assert stopped["token_ids"] == [first] and stopped["finish_reason"] == "stop"  # the stop token is kept
    one = generate(url, prompt, max_tokens=1, temperature=0).json()["choices"][0]
    assert one["token_ids"] == [first] and one["finish_reason"] in ("length", "stop")


BAD = [
    {},
    {"token_ids": []},
    {"token_ids": [1, "a"]},
    {"token_ids": [10**9]},
    {"token_ids": [-1]},
    {"token_ids": [1], "sampling_params": {"n": 0}},
    {"token_ids": [1], "sampling_params": {"max_tokens": 10**6}},
    {"token_ids": [1], "sampling_params": {"temperature": -1}},
    {"token_ids": [1], "sampling_params": {"top_k": -2}},
    {"token_ids": [1], "sampling_params": {"min_p": 1.5}},
    {"token_ids": [1], "sampling_params": {"ignore_eos": True}},
    {"token_ids": [1], "sampling_params": {"logprobs": 99}},
    {"token_ids": [1], "sampling_params": "hot"},
    {"token_ids": [1], "stream": True},
    {"token_ids": [1], "features": "mm"},
    {"token_ids": [1], "model": "someone-else"},
    {"token_ids": [1] * 200},
]


@pytest.mark.parametrize("body", BAD)
def test_generate_refuses_bad_input_with_a_reason(sidecar, body):
    r = httpx.post(f"{sidecar['url']}/inference/v1/generate", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"]


def test_streaming_with_the_official_openai_client(sidecar):
    import openai  # here, not at collection: each of the suite's workers collects every file

    client = openai.OpenAI(base_url=f"{sidecar['url']}/v1", api_key="unused")
    common = dict(
        model=sidecar["model"], messages=[{"role": "user", "content": "abcd"}], n=2, max_tokens=6, seed=3
    )
    whole = client.chat.completions.create(**common)
    parts: dict[int, str] = {0: "", 1: ""}
    finish, usage = {}, None
    for chunk in client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True}
    ):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert parts == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    # completions too; without stream_options no usage chunk
    chunks = list(
        client.completions.create(model=sidecar["model"], prompt="ab", max_tokens=4, seed=2, stream=True)
    )
    plain = client.completions.create(model=sidecar["model"], prompt="ab", max_tokens=4, seed=2)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert all(c.usage is None for c in chunks)


def test_stream_options_without_stream_is_refused(sidecar):
    body = {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}
    r = httpx.post(f"{sidecar['url']}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]
