"""The sidecar against hostile and oversized input (in process, through Starlette's TestClient): limits with
4xx that name them, errors in OpenAI's shape, fair batching, weight updates that are all or nothing."""

from __future__ import annotations

import shutil

import pytest
from fastapi.testclient import TestClient

from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine import HFEngine
from asyncrl.inference.builtin.server import build_app


@pytest.fixture(scope="module")
def engine(micro_model):
    return HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)


def client_for(engine, roots=None, **cfg) -> TestClient:
    engine.version = 0
    return TestClient(build_app(engine, InferenceConfig(**cfg), roots), client=("127.0.0.1", 5000))


def error(r, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(body) and body["code"] == status
    return body["message"]


def test_lone_surrogates_are_400_and_the_connection_lives_on(engine):
    with client_for(engine) as c:
        for route, body in (
            ("/v1/completions", '{"prompt": "ab\\ud800", "max_tokens": 2}'),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}'),
            ("/update_weights", '{"path": "\\ud800", "version": 1}'),
        ):
            assert "surrogate" in error(
                c.post(route, content=body, headers={"content-type": "application/json"}), 400
            )
        # found by schemathesis: was a 500
        nul = c.post("/update_weights", json={"path": "\x00", "version": 1})
        assert "path" in error(nul, 400)
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    "param,value",
    [
        ("best_of", 3),
        ("suffix", "x"),
        ("response_format", {"type": "json_object"}),
        ("repetition_penalty", 1.3),
        ("frequency_penalty", 0.5),
        ("logit_bias", {"1": 2}),
    ],
)
def test_unsupported_parameters_are_refused_by_name(engine, param, value):
    with client_for(engine) as c:
        assert param in error(c.post("/v1/completions", json={"prompt": "ab", param: value}), 400)
        ok = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1, "user": "me", "best_of": 1})
        assert ok.status_code == 200  # neutral values and harmless fields pass


def test_every_error_is_in_openais_shape_and_models_has_its_item_route(engine):
    with client_for(engine) as c:
        error(c.get("/nope"), 404)
        error(c.get("/v1/completions"), 405)
        error(
            c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
            400,
        )
        assert c.get(f"/v1/models/{engine.model_name}").json()["id"] == engine.model_name
        error(c.get("/v1/models/other"), 404)
        schema = c.get("/openapi.json").json()
        codes = {
            code for path in schema["paths"].values() for op in path.values() for code in op["responses"]
        }
        assert "422" not in codes and {"400", "403", "404", "413"} <= codes


def test_limits_name_themselves(engine):
    with client_for(engine, max_body_mb=0.01, max_request_rows=8) as c:
        assert "max_body_mb" in error(c.post("/v1/completions", json={"prompt": "a" * 20_000}), 413)
        assert "max_request_rows" in error(
            c.post("/v1/completions", json={"prompt": ["ab"] * 3, "n": 4}), 400
        )
    with client_for(engine) as c:
        huge = "a" * (engine.max_model_len * 64 + 1)  # refused by its length, before it is tokenized
        assert "cannot fit" in error(
            c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]}), 400
        )


def test_a_large_request_is_decoded_in_parts_and_gives_the_same_completions(engine):
    body = {
        "prompt": ["ab", "cd", "ef", "gh", "ij", "kl"],
        "n": 2,
        "max_tokens": 4,
        "seed": 3,
        "return_token_ids": True,
    }
    with client_for(engine) as c:
        whole = c.post("/v1/completions", json=body).json()
    with client_for(engine, max_batch_size=4) as c:
        before = c.get("/health").json()["stats"]["batches"]
        parts = c.post("/v1/completions", json=body).json()
        assert c.get("/health").json()["stats"]["batches"] - before >= 3
    assert [ch["token_ids"] for ch in parts["choices"]] == [ch["token_ids"] for ch in whole["choices"]]


def test_weight_updates_are_checked_before_anything_changes(engine, micro_model, tmp_path):
    inside = tmp_path / "run" / "weights" / "step_1"
    shutil.copytree(micro_model, inside)
    prompt = {"prompt": "abc", "max_tokens": 4, "temperature": 0, "logprobs": 0}
    with client_for(engine, roots=[(tmp_path / "run").resolve(), micro_model.resolve()]) as c:
        before = c.post("/v1/completions", json=prompt).json()["choices"][0]["logprobs"]["token_logprobs"]
        assert "outside" in error(c.post("/update_weights", json={"path": str(tmp_path), "version": 1}), 403)
        dotdot = str(inside / ".." / ".." / "..")
        assert "outside" in error(c.post("/update_weights", json={"path": dotdot, "version": 1}), 403)
        assert c.post("/update_weights", json={"path": str(inside), "version": 2}).status_code == 200
        assert "older" in error(c.post("/update_weights", json={"path": str(inside), "version": 1}), 409)
        # a reload
        assert c.post("/update_weights", json={"path": str(inside), "version": 2}).status_code == 200
        with (inside / "model.safetensors").open("r+b") as f:  # a truncated file: refused whole
            f.truncate(1000)
        assert "safetensors" in error(
            c.post("/update_weights", json={"path": str(inside), "version": 3}), 400
        )
        assert c.get("/health").json()["version"] == 2
        after = c.post("/v1/completions", json=prompt).json()["choices"][0]["logprobs"]["token_logprobs"]
        assert after == before  # the same weights as before the refused update
