"""Who may call the sidecars' admin routes: loopback callers not relayed by a proxy, or the bearer token."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from asyncrl.inference.admin import admin_refusal
from asyncrl.inference.vllm.backend import build_router


@pytest.mark.parametrize(
    "host,headers,token,allowed",
    [
        ("127.0.0.1", {}, None, True),
        ("::1", {}, None, True),
        ("10.0.0.2", {}, None, False),
        ("127.0.0.1", {"x-forwarded-for": "127.0.0.1"}, None, False),  # relayed: the real caller is unknown
        ("127.0.0.1", {"forwarded": "for=127.0.0.1"}, None, False),
        ("127.0.0.1", {"x-real-ip": "127.0.0.1"}, None, False),
        ("10.0.0.2", {"authorization": "Bearer s3cret"}, "s3cret", True),
        ("10.0.0.2", {"authorization": "Bearer wrong"}, "s3cret", False),
        ("10.0.0.2", {"authorization": "Bearer "}, "", False),  # an empty token is no token
    ],
)
def test_admin_refusal(host, headers, token, allowed):
    assert (admin_refusal(host, headers, token) is None) is allowed


def test_the_vllm_routes_refuse_a_remote_caller_that_a_trusting_proxy_setup_makes_look_local(tmp_path):
    """vLLM runs uvicorn with its defaults: with FORWARDED_ALLOW_IPS='*' the client address comes from
    X-Forwarded-For. Simulated here with uvicorn's own middleware, trusting every address."""

    app = FastAPI()
    app.include_router(build_router(admin_token=None, roots=[tmp_path]))
    trusting = ProxyHeadersMiddleware(app, trusted_hosts="*")
    remote = TestClient(trusting, client=("10.1.2.3", 50000))
    r = remote.post("/pause", headers={"X-Forwarded-For": "127.0.0.1"})
    assert r.status_code == 403 and "proxy" in r.json()["detail"]
    # passes the guard; refused for the path instead
    local = TestClient(trusting, client=("127.0.0.1", 50000))
    r = local.post("/update_weights", json={"path": "/elsewhere", "version": 1})
    assert r.status_code == 403 and "outside the directories" in r.json()["detail"]
