"""The ``asyncrl_chat`` harness's turn POST: which failures it retries, and that every attempt of one turn
carries one idempotency key (the interception server's replay contract; the end-to-end check against a real
interception server is in tests/integration/test_verifiers_env.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from tenacity import wait_none


@pytest.fixture
def chat():
    """The harness's module, imported by the tests rather than at collection: it imports verifiers (~4 s of
    CPU), which each of the suite's workers would otherwise import while collecting this file."""
    import asyncrl_chat

    return asyncrl_chat


def post_with(monkeypatch, chat, script: list) -> tuple[httpx.Response | BaseException, list[httpx.Request]]:
    """``post_turn`` against a server that answers the k-th request with ``script[k]`` (a status code, or an
    exception class to raise): (what ``post_turn`` returned or raised, the requests it sent)."""
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        step = script[len(sent) - 1]
        if isinstance(step, int):
            return httpx.Response(step, json={"error": f"status {step}"})
        raise step("injected", request=request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    monkeypatch.setattr(chat, "_client", lambda: client)
    monkeypatch.setattr(chat, "wait_exponential_jitter", lambda **_: wait_none())

    async def main():
        try:
            return await chat.post_turn("http://interception/v1/chat/completions", {"m": 1}, "secret")
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return e
        finally:
            await client.aclose()

    return asyncio.run(main()), sent


@pytest.mark.parametrize(
    "script",
    [
        [httpx.ReadError, 200],
        [httpx.RemoteProtocolError, 503, 200],
        [502, 429, 200],
        [501, 408, 200],
        [529, 200],
        [httpx.ConnectError, 200],
    ],
)
def test_transport_faults_and_retryable_statuses_are_retried_under_one_key(monkeypatch, chat, script):
    out, sent = post_with(monkeypatch, chat, script)
    assert isinstance(out, httpx.Response) and out.status_code == 200 and len(sent) == len(script)
    assert len({r.headers["Idempotency-Key"] for r in sent}) == 1
    assert [r.headers["x-stainless-retry-count"] for r in sent] == [str(k) for k in range(len(script))]
    assert all(r.headers["Authorization"] == "Bearer secret" for r in sent)


@pytest.mark.parametrize("status", [200, 400, 401, 409, 422])
def test_an_answer_or_a_refusal_is_final(monkeypatch, chat, status):
    """400 is a rollout stopped (max turns, a @stop), 409 a rollout concluded: retrying cannot change
    them."""
    out, sent = post_with(monkeypatch, chat, [status, 200])
    assert isinstance(out, httpx.Response) and out.status_code == status and len(sent) == 1


def test_the_last_failure_is_returned_or_raised_after_every_attempt(monkeypatch, chat):
    out, sent = post_with(monkeypatch, chat, [503] * chat.ATTEMPTS + [200])
    assert isinstance(out, httpx.Response) and out.status_code == 503 and len(sent) == chat.ATTEMPTS
    out, sent = post_with(monkeypatch, chat, [httpx.ReadError] * chat.ATTEMPTS + [200])
    assert isinstance(out, httpx.ReadError) and len(sent) == chat.ATTEMPTS
    # two turns never share a key
    _, a = post_with(monkeypatch, chat, [200])
    _, b = post_with(monkeypatch, chat, [200])
    assert a[0].headers["Idempotency-Key"] != b[0].headers["Idempotency-Key"]
