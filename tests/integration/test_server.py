"""The sidecar over real HTTP: the official openai client, malformed requests, admin routes."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from transformers import AutoModelForCausalLM

from asyncrl.config.compose import compose_config
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine import HFEngine
from asyncrl.inference.builtin.server import build_app
from asyncrl.inference.serve import KEEP_ALIVE_S
from asyncrl.models.hf import build_tiny_model
from asyncrl.rollouts.answers import LOGPROBS_ENCODING, LOGPROBS_ENCODING_FIELD, logprob_values
from helpers.launch import MICRO_MODEL, serve_sidecar
from helpers.processes import tree_memory


@pytest.fixture(scope="module")
def sidecar(micro_model, tmp_path_factory):
    # a common proxy setting: the sidecar must still not trust X-Forwarded-For for its admin routes
    with serve_sidecar(micro_model, tmp_path_factory, env={"FORWARDED_ALLOW_IPS": "*"}) as server:
        yield server


def test_openai_client_chat_and_completions(sidecar):
    import openai  # here, not at collection: each of the suite's workers collects every file

    client = openai.OpenAI(base_url=f"{sidecar['url']}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [sidecar["model"]]
    seeded = dict(
        model=sidecar["model"],
        messages=[{"role": "user", "content": "abc"}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"return_token_ids": True},
    )
    chat = client.chat.completions.create(**seeded, logprobs=True)
    assert len(chat.choices) == 3 and chat.usage.completion_tokens == sum(
        len(c.token_ids) for c in chat.choices
    )
    for c in chat.choices:
        assert len(c.logprobs.content) == len(c.token_ids) <= 6
        assert all(lp.logprob <= 0 for lp in c.logprobs.content)
        assert c.finish_reason in ("stop", "length")
    assert chat.prompt_token_ids and chat.choices[0].message.role == "assistant"
    again = client.chat.completions.create(**seeded)
    # seeded: reproducible
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in chat.choices]
    # asyncrl's compact logprobs (what its client asks for): the same numbers, one base64 array a choice
    compact = httpx.post(f"{sidecar['url']}/v1/chat/completions", timeout=60, json={
        **{k: v for k, v in seeded.items() if k != "extra_body"}, "return_token_ids": True, "logprobs": True,
        LOGPROBS_ENCODING_FIELD: LOGPROBS_ENCODING}).json()  # fmt: skip
    for c, ref in zip(compact["choices"], chat.choices, strict=True):
        assert c["logprobs"]["content"] is None and c["token_ids"] == ref.token_ids
        assert logprob_values(c["logprobs"], len(ref.token_ids)) == [e.logprob for e in ref.logprobs.content]
    comp = client.completions.create(
        model=sidecar["model"], prompt=["ab", "cd"], n=2, max_tokens=4, logprobs=1, seed=1
    )
    assert sorted(c.index for c in comp.choices) == [0, 1, 2, 3]
    assert len(comp.choices[0].logprobs.token_logprobs) == len(comp.choices[0].logprobs.tokens)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=sidecar["model"], messages=[{"role": "user", "content": "x"}], n=0
        )


MALFORMED = [
    ("/v1/chat/completions", b"not json"),
    ("/v1/chat/completions", b"[]"),
    ("/v1/chat/completions", {}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 10**9}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": [1]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream_options": {"x": 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": -3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "other"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": ["a"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": [[10**9]]}),
    ("/v1/completions", {"prompt": [-1]}),
    ("/v1/completions", {"prompt": "x", "echo": True}),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}),
    ("/v1/completions", {"prompt": [1, 2, 3], "prompt_logprobs": 5}),  # only the tokens' own logprob
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs_encoding": "json"}),
    ("/v1/completions", {"prompt": None}),
    ("/update_weights", {"path": "/definitely/not/here", "version": 1}),
    ("/update_weights", {"path": "", "version": 1}),
    ("/update_weights", {"version": -1}),
]


@pytest.mark.parametrize("route, body", MALFORMED)
def test_malformed_requests_get_4xx_with_a_reason(sidecar, route, body):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(sidecar["url"] + route, headers={"content-type": "application/json"}, timeout=30, **kw)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"]


def test_prompt_logprobs_are_a_plain_forward_of_the_prompt(sidecar, micro_model):
    """vLLM's prompt_logprobs on /v1/completions (what a distillation teacher answers): None for the first
    token, then each token's logprob given the ones before it, at temperature 1, in vLLM's layout."""

    ids = [5, 9, 3, 12, 7, 7, 20]
    body = {
        "model": sidecar["model"],
        "prompt": ids,
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "temperature": 0.5,
    }
    r = httpx.post(sidecar["url"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    model = AutoModelForCausalLM.from_pretrained(micro_model).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    for i, t in enumerate(ids[1:], start=1):
        (entry,) = got[i].items()
        assert entry[0] == str(t) and entry[1]["logprob"] == pytest.approx(float(logp[i - 1, t]), abs=1e-5)


def test_random_garbage_never_gets_a_5xx(sidecar):
    rng = random.Random(0)
    atoms = [None, True, 0, -1, 2**70, 1.5, float("inf"), "", "x", [], {}, [1, "a"], {"role": "user"}]
    keys = [
        "messages",
        "prompt",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "model",
        "stream",
        "stop_token_ids",
        "return_token_ids",
        "path",
        "version",
    ]

    def value(depth=0):
        if depth < 2 and rng.random() < 0.3:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if depth < 2 and rng.random() < 0.2:
            return {
                rng.choice(keys + ["role", "content"]): value(depth + 1) for _ in range(rng.randint(0, 3))
            }
        return rng.choice(atoms)

    for _ in range(150):
        body = {rng.choice(keys): value() for _ in range(rng.randint(0, 5))}
        if rng.random() < 0.5:
            body["messages"] = [{"role": "user", "content": rng.choice(["a", "", "zz"])}]
        if "max_tokens" not in body or not isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = 4  # keep the valid ones quick
        route = rng.choice(["/v1/chat/completions", "/v1/completions", "/update_weights"])
        text = json.dumps(body, allow_nan=True)
        r = httpx.post(
            sidecar["url"] + route, content=text, headers={"content-type": "application/json"}, timeout=60
        )
        assert r.status_code < 500, (route, text, r.text)
    assert httpx.get(sidecar["url"] + "/health").json()["status"] == "ok"


def test_update_weights_changes_outputs_and_restores(sidecar, tmp_path):
    other = build_tiny_model(compose_config(MICRO_MODEL).model.init, tmp_path / "other", seed=1)
    url = sidecar["url"]

    def greedy():
        body = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "return_token_ids": True,
        }
        c = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        return c["token_ids"], [x["logprob"] for x in c["logprobs"]["content"]]

    before = greedy()
    r = httpx.post(f"{url}/update_weights", json={"path": str(other), "version": 7}, timeout=60)
    assert r.status_code == 200 and r.json()["version"] == 7
    assert httpx.get(f"{url}/health").json()["version"] == 7
    assert greedy() != before
    r = httpx.post(f"{url}/update_weights", json={"path": sidecar["model"], "version": 8}, timeout=60)
    assert r.status_code == 200
    assert greedy() == before  # token for token, logprob for logprob


def test_update_weights_rejects_mismatched_weights(sidecar, tmp_path):
    wider = build_tiny_model(
        compose_config([*MICRO_MODEL, "model.init.hidden_size=96"]).model.init, tmp_path / "w", 0
    )
    r = httpx.post(f"{sidecar['url']}/update_weights", json={"path": str(wider), "version": 9}, timeout=60)
    assert r.status_code == 400 and "cannot load weights" in r.json()["error"]["message"]
    assert httpx.get(f"{sidecar['url']}/health").json()["status"] == "ok"


def test_pause_holds_requests_until_resume(sidecar):
    url = sidecar["url"]
    assert httpx.post(f"{url}/pause").json() == {"paused": True}
    body = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 3}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1.0)
    assert httpx.get(f"{url}/health").json()["paused"] is True
    assert httpx.post(f"{url}/resume").json() == {"paused": False}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_admin_routes_refuse_non_loopback_clients(micro_model):
    engine = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    with TestClient(build_app(engine, InferenceConfig())) as client:  # its client host is "testclient"
        for route in ("/update_weights", "/pause", "/resume"):
            r = client.post(route, json={"path": str(micro_model), "version": 1})
            assert r.status_code == 403 and "loopback" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200
    with TestClient(build_app(engine, InferenceConfig(admin_token="s3cret"))) as client:
        assert client.post("/pause", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert client.post("/pause", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.post("/resume", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_concurrent_requests_share_batches(sidecar):
    url = sidecar["url"]
    before = httpx.get(f"{url}/health").json()["stats"]

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 4, "n": 2}
            return await asyncio.gather(
                *(client.post(f"{url}/v1/chat/completions", json=body) for _ in range(16))
            )

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    after = httpx.get(f"{url}/health").json()["stats"]
    assert after["requests"] - before["requests"] == 16
    assert after["sequences"] - before["sequences"] == 32
    assert after["batches"] - before["batches"] < 16  # requests that arrive together are decoded together


def test_admin_routes_refuse_relayed_requests(sidecar):
    """With FORWARDED_ALLOW_IPS='*', uvicorn would take X-Forwarded-For as the client: a remote caller could
    then claim to be 127.0.0.1. A request a proxy relayed is refused whatever it claims (its real caller is
    unknown); a direct loopback caller is allowed."""
    url = sidecar["url"]
    for header in (
        {"X-Forwarded-For": "127.0.0.1"},
        {"Forwarded": "for=127.0.0.1"},
        {"X-Forwarded-For": "10.1.2.3"},
    ):
        r = httpx.post(f"{url}/pause", headers=header, timeout=30)
        assert r.status_code == 403 and "proxy" in r.json()["error"]["message"], header
    assert httpx.post(f"{url}/pause", timeout=30).status_code == 200
    assert httpx.post(f"{url}/resume", timeout=30).status_code == 200


# -- fuzzing: schemathesis against the OpenAPI schema, over real HTTP -------------------------------------


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_5xx_and_no_dropped_connection(sidecar, mode):
    """Requests generated from the OpenAPI schema (valid ones, then ones that break it) to every route: each
    answer is < 500, errors in OpenAI's shape, and the connection is never reset (that raises in call()).
    (schemathesis' pytest plugin does not load under pytest 9, so its strategies are driven here.)"""
    schema = schemathesis.openapi.from_url(f"{sidecar['url']}/openapi.json")

    @given(case=schema.as_strategy(GenerationMode(mode)))
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
            case.body["max_tokens"] = min(case.body["max_tokens"], 8)  # valid requests stay quick
        response = case.call(base_url=sidecar["url"], timeout=60)
        if case.path == "/pause":
            httpx.post(f"{sidecar['url']}/resume", timeout=30)
        assert response.status_code < 500, (case.path, case.body, response.text)
        if response.status_code >= 400:
            assert response.json()["error"]["message"]

    run()


def test_after_the_fuzzing_the_sidecar_is_healthy_and_its_memory_bounded(sidecar):
    start = time.monotonic()
    assert httpx.get(f"{sidecar['url']}/health", timeout=5).json()["status"] == "ok"
    assert time.monotonic() - start < 1.0
    # every process of the sidecar: the HTTP server and the engine process that holds the model and its
    # caches
    memory = tree_memory(sidecar["proc"].popen.pid)
    mib = {pid: round(b / 2**20) for pid, b in memory.items()}
    assert len(memory) >= 2, f"the engine process is not among the sidecar's processes (MiB per PID): {mib}"
    assert sum(memory.values()) < 2 * 2**30, f"sidecar memory after the fuzzing (MiB per PID): {mib}"


# -- property tests: hypothesis over the request models, in process ---------------------------------------

# any code point, lone surrogates included (valid JSON as \\udXXX escapes; hypothesis leaves them out by
# default), with the characters that broke servers before drawn often: uniform code points would almost never
# hit them
EDGE_CHARS = [
    "\ud800",
    "\udfff",
    "\x00",
    "\u2028",
    "\ufeff",
    "\U0010ffff",
    "\u0301",
    "\r",
    "{",
    "%",
    "<",
    "|",
]
ALPHABET = (
    st.sampled_from(EDGE_CHARS) | st.characters(categories=["Cs"]) | st.characters(exclude_categories=())
)
TEXT = st.text(ALPHABET, max_size=40) | st.sampled_from(
    ["<|end|>", "{{ messages }}", "{% raw %}", "\ud800<|user|>"]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80) | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "stop_token_ids",
    "return_token_ids",
    "token_ids",
    "sampling_params",
    "best_of",
    "response_format",
    "echo",
    "tools",
    "path",
    "version",
]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "nope"]) | JSON, "content": TEXT | JSON}
)
# the integers either side of int64's ends, which the engines' tensors and generators hold: drawn as often as
# the rest (hypothesis draws small integers far more often than large ones)
INT64_EDGES = [2**63 - 1, 2**63, 2**64, -(2**63) - 1, -(2**63)]
# mostly valid values, so that most requests reach the tokenizer and the engine, with hostile ones mixed in
SAMPLING = {
    "n": st.integers(1, 3) | st.integers(-3, 300),
    "max_tokens": st.integers(1, 8) | st.integers(-3, 10**6) | st.none(),
    "temperature": st.floats(0, 2) | st.floats(allow_nan=True) | st.none(),
    "seed": st.integers(0, 2**31) | st.integers(-5, 2**64) | st.sampled_from(INT64_EDGES),
    "top_k": st.integers(-1, 40) | st.integers(-(2**70), 2**70) | st.sampled_from(INT64_EDGES),
    "top_p": st.floats(0.1, 1) | st.floats(allow_nan=True),
    "min_p": st.floats(0, 1) | st.floats(allow_nan=True),
    "stop_token_ids": st.lists(st.integers(0, 40) | st.sampled_from(INT64_EDGES), max_size=3),
    "stop": TEXT | st.lists(TEXT, max_size=3),
    "logprobs": st.none() | st.booleans() | st.integers(0, 3) | JSON,
}
# a valid request with one integer field at an edge of int64: the rest of the body must pass for the value
# to reach the engine, which a body of many random fields rarely does
VALID = {
    "/v1/completions": {"prompt": [5, 6], "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2},
}
INT_FIELDS = ["n", "top_k", "seed", "max_tokens", "logprobs", "top_logprobs", "max_completion_tokens"]
ONE_INT_OFF = st.builds(
    lambda route, key, value: (route, {**VALID[route], key: value}),
    st.sampled_from(sorted(VALID)),
    st.sampled_from(INT_FIELDS),
    st.sampled_from(INT64_EDGES),
)
PROMPT = TEXT | st.lists(TEXT, min_size=1, max_size=3) | st.lists(st.integers(-2, 2**40), max_size=8) | JSON
REQUESTS = (
    ONE_INT_OFF
    | st.tuples(
        st.just("/v1/chat/completions"),
        st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=0, max_size=3)}, optional=SAMPLING),
    )
    | st.tuples(st.just("/v1/completions"), st.fixed_dictionaries({"prompt": PROMPT}, optional=SAMPLING))
    | st.tuples(
        st.sampled_from(
            ["/v1/completions", "/v1/chat/completions", "/update_weights", "/inference/v1/generate"]
        ),
        st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
    )
    | st.tuples(
        st.just("/inference/v1/generate"),
        st.fixed_dictionaries(
            {"token_ids": st.lists(st.integers(-2, 40), max_size=8) | JSON},
            optional={
                "sampling_params": st.fixed_dictionaries({}, optional=SAMPLING) | JSON,
                "stream": JSON,
            },
        ),
    )
)


@pytest.fixture(scope="module")
def in_process(micro_model):
    engine = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    with TestClient(
        build_app(engine, InferenceConfig(), roots=[micro_model.resolve()]), client=("127.0.0.1", 1)
    ) as c:
        c.model = engine.model_name
        yield c


@pytest.mark.parametrize("extra", [0, 1, 40], ids=["fills_the_context", "one_over", "far_over"])
def test_a_prompt_that_fills_the_context_with_max_tokens_unset_is_a_400_on_every_route(in_process, extra):
    """max_tokens unset means the rest of the context: a prompt as long as the context or longer leaves
    none, which is the caller's input (a 400 naming the context), never a 500 from the engine's KV cache."""
    ctx = in_process.get("/v1/models").json()["data"][0]["max_model_len"]
    ids = [5] * (ctx + extra)
    text = "a" * (ctx + extra)  # the micro model's tokenizer has one token per lowercase letter
    for route, body in (
        ("/inference/v1/generate", {"token_ids": ids}),
        ("/v1/completions", {"prompt": ids}),
        ("/v1/completions", {"prompt": text}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
    ):
        r = in_process.post(route, json={"model": in_process.model, **body})
        assert r.status_code == 400 and "context" in r.json()["error"]["message"], (route, r.text)


@pytest.mark.parametrize("top_k, status", [(2**63 - 1, 200), (2**63, 400), (-(2**70), 400)])
def test_an_integer_past_int64_is_a_400_naming_its_field(in_process, top_k, status):
    """The engine holds each row's top-k in an int64 tensor: a larger one is the caller's input (a 400 naming
    the field), never an overflow in the engine (a 500); the largest int64 is a top-k past the vocabulary,
    which is off. A rollout's imposed top-k takes the same bound."""
    sampling = {"top_k": top_k, "max_tokens": 2}
    for route, body in (
        ("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": sampling}),
        *((route, {**body, **sampling}) for route, body in VALID.items()),
        ("/rollouts", {"sampling": {"top_k": top_k}}),
    ):
        r = in_process.post(route, json={"model": in_process.model, **body})
        assert r.status_code == status, (route, r.text)
        assert status == 200 or "top_k" in r.json()["error"]["message"], (route, r.text)


@given(request=REQUESTS)
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_any_json_body_gets_an_answer_below_500_in_openais_shape(in_process, request):
    route, body = request
    for where in (body, body.get("sampling_params")):
        if isinstance(where, dict) and isinstance(where.get("max_tokens"), int) and where["max_tokens"] > 8:
            where["max_tokens"] = 8  # valid requests stay quick; the bounds are fuzzed by the smaller values
    r = in_process.post(
        route, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}
    )
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["code"] == r.status_code


def test_sidecars_keep_idle_connections_longer_than_clients_pool_them():
    """A server that closes an idle connection when a client may still reuse it from its pool races the
    client's next request: verifiers' clients make no retries, so the episode failed ("Connection error",
    seen in CI)."""

    assert KEEP_ALIVE_S > 2 * httpx.Limits(max_connections=None).keepalive_expiry
