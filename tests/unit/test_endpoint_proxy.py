"""The sandboxed agent's one way out (:class:`asyncrl.sandbox.agents.EndpointProxy`): ``/v1/...`` reaches its
rollout's base URL, streamed; every other target, a malformed request or an oversized body is answered with a
4xx and reaches nothing."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from asyncrl.sandbox import agents
from asyncrl.sandbox.agents import EndpointProxy

BASE = "http://sidecar:1234/rollouts/KEY/v1"


@contextlib.asynccontextmanager
async def proxied(upstream):
    """A proxy in front of ``upstream`` (an httpx mock handler), and a client of its Unix socket."""
    async with EndpointProxy(BASE, 10.0, httpx.MockTransport(upstream)) as proxy:
        transport = httpx.AsyncHTTPTransport(uds=str(proxy.path))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:9") as client:
            yield proxy, client


def through_proxy(requests, raw: bytes | None = None):
    """Send ``requests`` ((method, target, body)) through a proxy on an upstream that records what reaches
    it; ``(answers, upstream's (method, url, headers, body))``, and the raw answer to ``raw`` bytes if
    given."""
    seen = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), dict(request.headers), request.content))

        async def chunks():
            for chunk in (b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"):
                yield chunk

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())

    async def main():
        async with proxied(upstream) as (proxy, client):
            answers = [
                await client.request(m, t, content=b, headers={"Authorization": "Bearer x"})
                for m, t, b in requests
            ]
            raw_answer = None
            if raw is not None:
                reader, writer = await asyncio.open_unix_connection(str(proxy.path))
                writer.write(raw)
                await writer.drain()
                raw_answer = await reader.read(4096)
                writer.close()
        return answers, raw_answer

    answers, raw_answer = asyncio.run(main())
    return answers, seen, raw_answer


def test_v1_requests_reach_the_rollouts_url_streamed_without_the_agents_headers():
    answers, seen, _ = through_proxy(
        [("POST", "/v1/chat/completions?x=1", b'{"model": "m"}'), ("GET", "/v1/models", b"")]
    )
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].text == 'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    assert answers[0].headers["content-type"] == "text/event-stream"
    (m1, url1, headers1, body1), (m2, url2, _, _) = seen
    assert (m1, url1, body1) == ("POST", f"{BASE}/chat/completions?x=1", b'{"model": "m"}')
    assert (m2, url2) == ("GET", f"{BASE}/models")
    assert "authorization" not in headers1  # the agent's key stays inside


def test_every_other_target_is_refused_here():
    targets = [
        "/rollouts",
        "/admin/weights",
        "/v1/../rollouts",
        "/v1/%2e%2e/rollouts",
        "/v1/..%2fadmin",
        "/v2/x",
        "/",
    ]
    answers, seen, _ = through_proxy([("GET", t, b"") for t in targets])
    assert [a.status_code for a in answers] == [404] * len(targets)
    assert all("serves /v1/... only" in a.json()["error"]["message"] for a in answers)
    assert seen == []


def test_an_absolute_form_target_goes_nowhere_else():
    _, seen, raw = through_proxy([], raw=b"GET http://evil:80/v1/models HTTP/1.1\r\nHost: evil\r\n\r\n")
    assert raw is not None and raw.startswith(b"HTTP/1.1 404") and seen == []


def test_a_malformed_request_gets_a_400():
    _, seen, raw = through_proxy([], raw=b"NOT HTTP AT ALL\r\n\r\n")
    assert raw is not None and raw.startswith(b"HTTP/1.1 400") and b"malformed request" in raw and seen == []


def test_an_oversized_body_gets_a_413(monkeypatch):
    monkeypatch.setattr(agents, "MAX_BODY", 1000)
    answers, seen, _ = through_proxy([("POST", "/v1/chat/completions", b"x" * 5000)])
    assert answers[0].status_code == 413 and seen == []


def test_an_agent_holds_at_most_max_requests_in_the_proxy_at_once():
    """However many connections it opens, at most MAX_REQUESTS of its requests are read and forwarded at once
    (the rest wait unread), and all are answered."""
    live, peak = 0, 0

    async def upstream(request: httpx.Request) -> httpx.Response:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.05)
        live -= 1
        return httpx.Response(200, json={"ok": True})

    async def main():
        async with proxied(upstream) as (_, client):
            return await asyncio.gather(*(client.get("/v1/models") for _ in range(5 * agents.MAX_REQUESTS)))

    answers = asyncio.run(main())
    assert [a.status_code for a in answers] == [200] * 5 * agents.MAX_REQUESTS
    assert peak == agents.MAX_REQUESTS
