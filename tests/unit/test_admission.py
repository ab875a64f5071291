"""A burst of requests whose first steps each hold the event loop does not delay ``/health`` behind all of
them (:class:`asyncrl.inference.builtin.admission.Admission`), and every request of the burst still gets in,
in order."""

from __future__ import annotations

import asyncio
import time

from asyncrl.inference.builtin.admission import Admission

BURST = 300
STEP_S = 0.005  # each request's first step holds the loop this long: the burst's steps take 1.5 s in all


async def blocking_app(scope, receive, send) -> None:
    """Answers ``/health`` at once; any other path first holds the loop for ``STEP_S``, as parsing,
    validating and routing a request do, all in one step."""
    if scope["path"] != "/health":
        time.sleep(STEP_S)  # on the loop on purpose: the work a turn of the loop is made of
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": scope["path"].encode()})


async def burst(app) -> tuple[float, list[str]]:
    """``BURST`` requests and a ``/health`` that arrive in the same turn of the loop: how long ``/health``
    took, and the paths in the order their answers went out."""
    answered: list[str] = []

    async def call(path: str) -> float:
        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            if message["type"] == "http.response.body":
                answered.append(message["body"].decode())

        await app({"type": "http", "path": path}, receive, send)
        return time.perf_counter() - arrived

    arrived = time.perf_counter()
    calls = [asyncio.create_task(call(f"/v1/chat/completions/{i}")) for i in range(BURST)]
    health = asyncio.create_task(call("/health"))
    took = await health
    await asyncio.gather(*calls)
    return took, answered


def test_health_is_answered_while_a_burst_is_admitted():
    took, answered = asyncio.run(burst(Admission(blocking_app, per_turn=16)))
    # admitted 16 per turn, /health is answered within the first share of the burst; let in all at once (the
    # app without Admission) it is answered after all of it. The order says so whatever the machine's load;
    # the time it took (about 0.1 s against 1.5 s) only goes into the message
    where = answered.index("/health")
    assert where <= 16, f"/health answered after {where} requests of a burst of {BURST} ({took:.2f} s)"
    chats = [p for p in answered if p != "/health"]
    assert chats == [f"/v1/chat/completions/{i}" for i in range(BURST)]  # every one, first come first in


def test_without_admission_health_waits_for_the_whole_burst():
    """What the test above tells apart: the bare app answers /health after every request of the burst."""
    _, answered = asyncio.run(burst(blocking_app))
    assert answered.index("/health") == BURST


def test_a_request_cancelled_while_it_waits_does_not_take_a_turn():
    async def scenario() -> list[str]:
        admission = Admission(blocking_app, per_turn=1)
        answered: list[str] = []

        async def call(path: str) -> None:
            async def send(message):
                if message["type"] == "http.response.body":
                    answered.append(message["body"].decode())

            await admission({"type": "http", "path": path}, None, send)

        tasks = [asyncio.create_task(call(f"/r{i}")) for i in range(4)]
        await asyncio.sleep(0)  # all four arrive; /r0 goes straight in, the rest wait
        tasks[1].cancel()  # its client went away
        await asyncio.gather(*tasks, return_exceptions=True)
        assert not admission.waiting and not admission.pumping
        return answered

    assert asyncio.run(scenario()) == ["/r0", "/r2", "/r3"]
