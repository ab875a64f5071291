"""Client side of the sidecar(s): OpenAI-API rollouts and the admin calls that relay new weights.

Requests use the OpenAI chat-completions wire format over httpx, to any server that returns token ids
and logprobs (our sidecar, or vLLM with ``return_token_ids``); with several servers each request goes
to the one with the fewest requests in flight. (The ``openai`` package works against the sidecar too,
see the tests, but building its typed response objects cost the orchestrator ~40 ms of CPU per step on
the 2-core default, where the sidecar and trainer need every cycle.) Admin calls (``/update_weights``) go
to every server, with retries on connection errors only: a 4xx means the weights are wrong, and retrying
would not help.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

log = logging.getLogger(__name__)


@dataclass
class ChoiceOut:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


@dataclass
class ChatOut:
    prompt_ids: list[int]
    choices: list[ChoiceOut]


class InferencePool:
    def __init__(
        self,
        urls: list[str],
        model: str,
        request_timeout_s: float,
        max_concurrency: int,
        admin_token: str | None = None,
        extra_body: dict | None = None,
    ):
        if not urls:
            raise ValueError("no inference server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.extra_body = dict(extra_body or {})
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        limits = httpx.Limits(max_connections=max_concurrency * 2, max_keepalive_connections=max_concurrency * 2)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=5.0), headers=headers, limits=limits
        )
        self.inflight = [0] * len(self.urls)
        self.served = [0] * len(self.urls)  # requests sent to each server, for the metrics
        self.limit = asyncio.Semaphore(max_concurrency)

    async def close(self) -> None:
        await self.http.aclose()

    async def wait_healthy(self, timeout_s: float) -> None:
        """Wait until every server answers ``/health``, saying every 10 s what it waits for; a server that
        never answers is a :class:`ConfigError` naming ``inference.urls`` (exit 2, no traceback)."""
        from asyncrl.config import ConfigError

        start = time.monotonic()
        for url in self.urls:
            said, last = start, "no answer yet"
            while True:
                try:
                    resp = await self.http.get(f"{url}/health", timeout=2.0)
                    if resp.status_code == 200:
                        break
                    last = f"/health answered {resp.status_code}"
                except httpx.HTTPError as e:
                    last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                waited = time.monotonic() - start
                if waited > timeout_s:
                    raise ConfigError(
                        f"invalid config:\n  inference.urls={self.urls}: no sidecar answered at {url} within "
                        f"inference.startup_timeout_s={timeout_s:.0f} ({last}); start one with `asyncrl serve`, or "
                        "fix the URL"
                    )
                if time.monotonic() - said >= 10:
                    said = time.monotonic()
                    log.info(f"waiting for the sidecar at {url} ({waited:.0f} s of {timeout_s:.0f}; {last})")
                await asyncio.sleep(0.2)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[str]:
        """The URL of the server with the fewest requests in flight, counted as one more while the block runs
        (an episode that makes its own requests, such as a verifiers episode's turns, holds one slot)."""
        async with self.limit:
            i = min(range(len(self.urls)), key=lambda j: self.inflight[j])
            self.inflight[i] += 1
            self.served[i] += 1
            try:
                yield self.urls[i]
            finally:
                self.inflight[i] -= 1

    async def chat(
        self, messages: list[dict], n: int, temperature: float, top_p: float, max_tokens: int, seed: int | None
    ) -> ChatOut:
        """``n`` completions of one chat prompt, with the sampled tokens' ids and (processed) logprobs."""
        body = {
            "model": self.model,
            "messages": messages,
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "seed": seed,
            "logprobs": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **self.extra_body,
        }
        async with self.slot() as url:
            data = await self._post_chat(url, body)
        choices = []
        for ch in sorted(data["choices"], key=lambda c: c["index"]):
            if ch.get("token_ids") is None or not ch.get("logprobs"):
                raise RuntimeError(
                    f"server {url} returned no token ids/logprobs; it must support vLLM's return_token_ids and logprobs"
                )
            lps = [c["logprob"] for c in ch["logprobs"]["content"]]
            choices.append(ChoiceOut(ch["token_ids"], lps, ch["message"].get("content") or "", ch["finish_reason"]))
        return ChatOut(data.get("prompt_token_ids") or [], choices)

    @retry(
        retry=retry_if_exception_type(httpx.TransportError),
        stop=stop_after_attempt(3),
        wait=wait_exponential(multiplier=0.5, max=4),
        reraise=True,
    )
    async def _post_chat(self, url: str, body: dict) -> dict[str, Any]:
        resp = await self.http.post(f"{url}/v1/chat/completions", json=body)
        if resp.status_code != 200:  # a 4xx is our bug or a misconfigured model: fail loudly
            raise RuntimeError(f"{url}/v1/chat/completions failed ({resp.status_code}): {resp.text[:500]}")
        return resp.json()

    async def versions(self) -> list[int]:
        """The policy version each server holds (``GET /policy``, served by every asyncrl sidecar)."""
        return [int((await self.http.get(f"{u}/policy")).json()["version"]) for u in self.urls]

    async def init_weight_transfer(self, host: str, port: int, workers_per_server: int) -> None:
        """Have every server join the trainer's NCCL group (ranks 1..; the trainer is 0). Returns once the
        whole group has formed, so all servers are asked at once."""
        world = 1 + workers_per_server * len(self.urls)

        async def join(i: int, url: str) -> None:
            body = {
                "master_address": host,
                "master_port": port,
                "rank_offset": 1 + i * workers_per_server,
                "world_size": world,
            }
            resp = await self.http.post(f"{url}/init_weight_transfer", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"{url}/init_weight_transfer failed ({resp.status_code}): {resp.text}")

        await asyncio.gather(*(join(i, u) for i, u in enumerate(self.urls)))

    async def update_weights(self, path: str, version: int) -> float:
        """Load ``path`` as policy ``version`` on every server; returns the slowest load's seconds."""
        results = await asyncio.gather(*(self._update_one(u, path, version) for u in self.urls))
        return max(r.get("seconds", 0.0) for r in results)

    @retry(
        retry=retry_if_exception_type(httpx.TransportError),
        stop=stop_after_attempt(5),
        wait=wait_exponential(multiplier=0.2, max=5),
        reraise=True,
    )
    async def _update_one(self, url: str, path: str, version: int) -> dict[str, Any]:
        resp = await self.http.post(f"{url}/update_weights", json={"path": path, "version": version})
        if resp.status_code != 200:
            raise RuntimeError(f"{url}/update_weights failed ({resp.status_code}): {resp.text}")
        return resp.json()
