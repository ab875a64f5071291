"""A stand-in inference server: the sidecar's wire protocol with no model behind it (tests, benchmarks).

It answers ``/v1/chat/completions`` with made-up tokens after ``delay_s(body, choice)`` seconds (default: at
once), reports every token's policy version like asyncrl's sidecar, and takes ``/update_weights`` without
reading anything. What the orchestrator does per rollout can then be measured, or timed against a chosen
latency distribution (a heavy tail), with no engine in the way. ``app.state.standin["hung"] = True`` makes it
stop answering anything (a wedged server) until set back; ``app.state.standin["dying"] = True`` makes it
answer ``/update_weights`` and chat requests with 503, as a sidecar whose engine process died does.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def build_standin(
    length: Callable[[dict, int], int] | None = None,
    seconds: Callable[[dict, int, int], float] | None = None,
) -> FastAPI:
    """``length(body, choice)``: tokens of each choice (default ``max_tokens``); ``seconds(body, choice,
    length)``: how long the request takes (the slowest choice; default 0)."""
    app = FastAPI()
    state = {"version": 0, "requests": 0, "hung": False, "dying": False}
    dying = JSONResponse({"error": {"message": "the engine process died", "code": 503}}, status_code=503)
    app.state.standin = state

    async def answer_unless_hung() -> None:
        while state["hung"]:
            await asyncio.sleep(0.05)

    @app.get("/health")
    async def health() -> dict:
        await answer_unless_hung()
        return {"status": "ok", "version": state["version"]}

    @app.get("/policy")
    async def policy() -> dict:
        return {"version": state["version"]}

    @app.post("/update_weights", response_model=None)
    async def update(request: Request) -> dict | JSONResponse:
        if state["dying"]:
            return dying
        body = await request.json()
        state["version"] = int(body["version"])
        return {"version": state["version"], "seconds": 0.0}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> dict | JSONResponse:
        body = await request.json()
        state["requests"] += 1
        await answer_unless_hung()
        if state["dying"]:
            return dying
        lengths = [length(body, c) if length else body["max_tokens"] for c in range(body.get("n", 1))]
        wait = max((seconds(body, c, n) if seconds else 0.0) for c, n in enumerate(lengths))
        if wait:
            await asyncio.sleep(wait)
        rng = random.Random(f"{body.get('seed')}")
        choices = []
        for c, n in enumerate(lengths):
            text = "".join(rng.choice("abcdefgh") for _ in range(n))
            tokens = [3 + ord(ch) % 60 for ch in text]
            choices.append(
                {
                    "index": c,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length" if n >= body["max_tokens"] else "stop",
                    "token_ids": tokens,
                    "policy_versions": [state["version"]] * n,
                    "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -1.0} for t in tokens]},
                }
            )
        return {
            "id": "standin",
            "object": "chat.completion",
            "choices": choices,
            "prompt_token_ids": [1, 2, 3, 4],
        }

    return app


@contextlib.contextmanager
def serve_standin(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` on a free local port in a thread until the block ends; yields its URL."""
    from asyncrl.utils.process import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the stand-in server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
