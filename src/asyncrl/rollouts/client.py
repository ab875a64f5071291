"""Client side of the sidecar(s): OpenAI-API rollouts and the admin calls that relay new weights.

Requests use the OpenAI chat-completions wire format over httpx, to any server that returns token ids and
logprobs (our sidecar, or vLLM with ``return_token_ids``); with several servers each request goes to the
healthy one with the fewest requests in flight. (The ``openai`` package works against the sidecar too, see
the tests, but building its typed response objects costs the orchestrator CPU every step, and on the 2-core
default the sidecar and trainer need every cycle; ``python benchmarks/rollouts.py`` measures the client.)
Admin calls (``/update_weights``) go to every server in rotation, with retries on connection errors only: a
4xx means the weights are wrong, and retrying would not help.

Failover: a server that fails a request (connection error, timeout, 5xx), or is hung (no answer to
``/health`` for ``orchestrator.health_check_s``, three times in a row), is taken out of rotation; its
in-flight requests are abandoned at once and sent to the others (bounded retries, with tenacity), or, with
one server, to it again once it is back (the launcher restarts a dead sidecar). A background check polls the
servers out of rotation; one that answers again is first brought to the current policy (``/update_weights``
with the last weights relayed), then gets traffic again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from asyncrl.config.fields import ConfigError
from asyncrl.rollouts.answers import LOGPROBS_ENCODING, LOGPROBS_ENCODING_FIELD, ChatOut, read_chat

log = logging.getLogger(__name__)


CLIENT_CONNECTIONS = 256  # completion requests in flight per HTTP client (see InferencePool.__init__)


class ServerDown(Exception):
    """A request's server left rotation while the request ran, or answered as a dying server does (5xx)."""


class InferencePool:
    def __init__(
        self,
        urls: list[str],
        model: str,
        request_timeout_s: float,
        max_concurrency: int,
        admin_token: str | None = None,
        extra_body: dict | None = None,
        max_retries: int = 3,
        recovery_timeout_s: float = 180.0,
    ):
        """``max_retries``: further attempts of a request whose server failed; ``recovery_timeout_s``: how
        long a request waits for a server in rotation when none is."""
        if not urls:
            raise ValueError("no inference server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.extra_body = dict(extra_body or {})
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        limits = httpx.Limits(
            max_connections=max_concurrency * 2, max_keepalive_connections=max_concurrency * 2
        )
        # Completion requests are spread over several clients of at most CLIENT_CONNECTIONS requests each:
        # httpcore 1.0's pool does O(connections^2) work per request (encode/httpcore#1035, unmerged), which
        # took 80% of the orchestrator's CPU with 4,096 requests in flight on one client. one CA load
        timeout, tls = httpx.Timeout(request_timeout_s, connect=5.0), httpx.create_ssl_context()
        self.clients = [
            httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits, verify=tls)
            for _ in range(-(-max_concurrency // CLIENT_CONNECTIONS))
        ]
        self.http = self.clients[0]  # admin calls, health checks
        self._sent = 0  # completion requests sent, for the round robin over clients
        self.inflight = [0] * len(self.urls)
        self.served = [0] * len(self.urls)  # requests sent to each server, for the metrics
        self.server_versions = [0] * len(self.urls)  # the policy each server holds, as far as we know
        self.limit = asyncio.Semaphore(max_concurrency)
        self.max_retries, self.recovery_timeout_s = max_retries, recovery_timeout_s
        self.up = [True] * len(self.urls)  # in rotation
        # done when a server leaves rotation: one future per server that every request to it waits on, rather
        # than a task per request (at 4,096 requests in flight, those tasks were garbage the collector
        # walked)
        self._down: list[asyncio.Future | None] = [None] * len(self.urls)
        self.any_up = asyncio.Event()
        self.any_up.set()
        self.current: tuple[str, int] | None = None  # the last policy relayed: (path, version)
        self.failovers = 0  # servers taken out of rotation
        self.retried = 0  # requests sent again after their server failed
        self._watch: asyncio.Task | None = None  # brings servers back into rotation
        self._health: asyncio.Task | None = None  # takes hung servers out

    async def close(self) -> None:
        for task in (self._watch, self._health):
            if task is not None:
                task.cancel()
        for client in self.clients:
            await client.aclose()

    # -- failover ---------------------------------------------------------------------------------------
    def mark_down(self, i: int, why: str) -> None:
        """Take server ``i`` out of rotation: its running requests go elsewhere, the watcher brings it
        back."""
        if not self.up[i]:
            return
        self.up[i] = False
        self.failovers += 1
        down = self._down[i]
        if down is not None and not down.done():
            down.set_result(None)
        if not any(self.up):
            self.any_up.clear()
        log.warning(f"{self.urls[i]} taken out of rotation ({why}); {sum(self.up)} of {len(self.urls)} left")
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._bring_back())

    def watch_health(self, every_s: float, misses: int = 3) -> None:
        """Start checking the servers in rotation: one that does not answer ``/health`` within ``every_s``,
        ``misses`` times in a row, is hung (a stopped process, a wedged event loop) and leaves rotation. A
        request to it would only fail at ``request_timeout_s``, minutes later. Three misses, not one: a CPU
        sidecar under a burst can be late once without being hung."""
        self._health = asyncio.create_task(self._check_health(every_s, misses))

    async def _check_health(self, every_s: float, misses: int) -> None:
        missed = [0] * len(self.urls)

        async def check(i: int) -> None:
            try:
                ok = (await self.http.get(f"{self.urls[i]}/health", timeout=every_s)).status_code == 200
            except httpx.ConnectError:  # refused: the process is gone, no need to wait for more misses
                missed[i] = 0
                self.mark_down(i, "/health: connection refused")
                return
            except httpx.HTTPError:
                ok = False
            missed[i] = 0 if ok else missed[i] + 1
            if missed[i] >= misses and self.up[i]:
                missed[i] = 0
                self.mark_down(i, f"no answer to /health within {every_s:g} s, {misses} times in a row")

        while True:
            start = time.monotonic()
            await asyncio.gather(*(check(i) for i in range(len(self.urls)) if self.up[i]))
            await asyncio.sleep(max(0.0, every_s - (time.monotonic() - start)))

    async def _bring_back(self, every_s: float = 0.5) -> None:
        """Poll the servers out of rotation; bring each that answers to the current policy, then put it
        back."""
        while not all(self.up):
            for i, url in enumerate(self.urls):
                if self.up[i]:
                    continue
                try:
                    if (await self.http.get(f"{url}/health", timeout=2.0)).status_code != 200:
                        continue
                    held = int((await self.http.get(f"{url}/policy", timeout=5.0)).json()["version"])
                    if self.current is not None and held != self.current[1]:
                        await self._update_one(url, *self.current)
                    self.server_versions[i] = self.current[1] if self.current is not None else held
                except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as e:
                    log.debug(f"{url} not back yet: {e}")
                    continue
                self._down[i] = None
                self.up[i] = True
                self.any_up.set()
                log.warning(f"{url} back in rotation at policy {self.server_versions[i]}")
            await asyncio.sleep(every_s)

    def take_counts(self) -> dict[str, int]:
        """Servers taken out of rotation and requests sent again since the last call (only those that
        happened)."""
        counts = {"inference/failovers": self.failovers, "inference/retried_requests": self.retried}
        self.failovers = self.retried = 0
        return {k: v for k, v in counts.items() if v}

    async def wait_healthy(self, timeout_s: float) -> None:
        """Wait until every server answers ``/health``, saying every 10 s what it waits for; a server that
        never answers is a :class:`ConfigError` naming ``inference.urls`` (exit 2, no traceback)."""
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
                        f"invalid config:\n  inference.urls={self.urls}: no sidecar answered at "
                        f"{url} within inference.startup_timeout_s={timeout_s:.0f} ({last}); "
                        "start one with `asyncrl serve`, or "
                        "fix the URL"
                    )
                if time.monotonic() - said >= 10:
                    said = time.monotonic()
                    log.info(f"waiting for the sidecar at {url} ({waited:.0f} s of {timeout_s:.0f}; {last})")
                await asyncio.sleep(0.2)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[str]:
        """The URL of the server in rotation with the fewest requests in flight, counted as one more while
        the block runs (an episode that makes its own requests, such as a verifiers episode's turns, holds
        one slot). With no server in rotation it waits up to ``recovery_timeout_s`` for one."""
        async with self.limit:
            if not self.any_up.is_set():
                try:
                    await asyncio.wait_for(self.any_up.wait(), self.recovery_timeout_s)
                except TimeoutError:
                    raise RuntimeError(
                        "no inference server back in rotation within "
                        f"{self.recovery_timeout_s:.0f} s: {self.urls}"
                    ) from None
            i = min((j for j in range(len(self.urls)) if self.up[j]), key=lambda j: self.inflight[j])
            self.inflight[i] += 1
            self.served[i] += 1
            try:
                yield self.urls[i]
            finally:
                self.inflight[i] -= 1

    async def chat(
        self,
        messages: list[dict],
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int | None,
        **truncation: float,
    ) -> ChatOut:
        """``n`` completions of a chat prompt, with token ids and processed logprobs (plus vLLM's top_k,
        min_p)."""
        body = {
            "model": self.model,
            "messages": messages,
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            **truncation,
            "max_tokens": max_tokens,
            "seed": seed,
            "logprobs": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            # one array a choice, where the server knows the field
            LOGPROBS_ENCODING_FIELD: LOGPROBS_ENCODING,
            **self.extra_body,
        }
        data, url, sent_version = await self._chat_with_failover(body)
        return read_chat(data, url, sent_version)

    async def _chat_with_failover(self, body: dict) -> tuple[dict[str, Any], str, int]:
        """Post ``body`` to a server in rotation; if that server fails or leaves rotation meanwhile, take it
        out and send the request again (up to ``max_retries`` more times).
        ``(response, url, version at send)``."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type((httpx.TransportError, ServerDown)),
            stop=stop_after_attempt(1 + self.max_retries),
            wait=wait_exponential(multiplier=0.2, max=2),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    self.retried += 1
                async with self.slot() as url:
                    i = self.urls.index(url)
                    sent_version = self.server_versions[i]
                    return await self._post_chat(i, body), url, sent_version
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def _post_chat(self, i: int, body: dict) -> dict[str, Any]:
        url, gone = self.urls[i], self._down[i]
        if gone is None:
            gone = self._down[i] = asyncio.get_running_loop().create_future()
        self._sent += 1
        client = self.clients[self._sent % len(self.clients)]
        post = asyncio.ensure_future(client.post(f"{url}/v1/chat/completions", json=body))
        try:
            await asyncio.wait([post, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this episode is cancelled (a stale group, the end of the run)
            abandoned = not post.done()
            if abandoned:
                post.cancel()
        if abandoned:  # the server left rotation while this request ran: send it elsewhere
            raise ServerDown(url)
        try:
            resp = post.result()
        except httpx.TransportError as e:
            # refused: not listening; the request's own timeout: hung for request_timeout_s. A reset or a
            # slow connect is a dead server only if it now refuses connections: under a burst of thousands of
            # requests a loaded server can drop one, and taking it out would abandon all the others
            if isinstance(
                e, httpx.ConnectError | httpx.ReadTimeout | httpx.WriteTimeout
            ) or await self._refuses(i):
                self.mark_down(i, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            raise
        if resp.status_code >= 500:  # a dying server (the engine process died: 503)
            self.mark_down(i, f"{resp.status_code}: {resp.text[:200]}")
            raise ServerDown(url)
        if resp.status_code != 200:  # a 4xx is our bug or a misconfigured model: fail loudly
            raise RuntimeError(f"{url}/v1/chat/completions failed ({resp.status_code}): {resp.text[:500]}")
        return resp.json()

    async def _refuses(self, i: int) -> bool:
        """Whether server ``i`` refuses a connection now (its process is gone); a slow answer is not a
        refusal."""
        try:
            await self.http.get(f"{self.urls[i]}/health", timeout=2.0)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass
        return False

    async def versions(self) -> list[int]:
        """The policy version each server holds (``GET /policy``, served by every asyncrl sidecar)."""
        self.server_versions = [
            int((await self.http.get(f"{u}/policy")).json()["version"]) for u in self.urls
        ]
        return list(self.server_versions)

    async def join_group(self, bodies: list[dict[str, Any]]) -> None:
        """Have server ``i`` join the weight transport's group with ``bodies[i]`` (``POST
        /init_weight_transfer``; the transport's :meth:`~asyncrl.transport.base.Transport.connect` writes
        them). Returns once the whole group has formed, so all servers are asked at once."""

        async def join(url: str, body: dict[str, Any]) -> None:
            resp = await self.http.post(f"{url}/init_weight_transfer", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"{url}/init_weight_transfer failed ({resp.status_code}): {resp.text}")

        await asyncio.gather(*(join(u, b) for u, b in zip(self.urls, bodies, strict=True)))

    async def update_weights(self, path: str, version: int) -> float:
        """Load ``path`` as policy ``version`` on every server in rotation (one that fails to take it leaves
        rotation and gets it when it is back); returns the slowest load's seconds."""
        self.current = (path, version)
        live = [i for i in range(len(self.urls)) if self.up[i]]
        results = await asyncio.gather(
            *(self._update_one(self.urls[i], path, version) for i in live), return_exceptions=True
        )
        seconds = 0.0
        for i, r in zip(live, results, strict=True):
            if isinstance(r, httpx.TransportError | ServerDown):
                self.mark_down(i, f"update_weights: {r}" if isinstance(r, ServerDown) else type(r).__name__)
            elif isinstance(r, BaseException):
                raise r
            else:
                self.server_versions[i] = version
                seconds = max(seconds, r.get("seconds", 0.0))
        return seconds

    @retry(
        retry=retry_if_exception_type(httpx.TransportError),
        stop=stop_after_attempt(5),
        wait=wait_exponential(multiplier=0.2, max=5),
        reraise=True,
    )
    async def _update_one(self, url: str, path: str, version: int) -> dict[str, Any]:
        resp = await self.http.post(f"{url}/update_weights", json={"path": path, "version": version})
        # a dying server (the engine process died: 503): it gets the policy when back
        if resp.status_code >= 500:
            raise ServerDown(f"{resp.status_code}: {resp.text[:200]}")
        if resp.status_code != 200:
            raise RuntimeError(f"{url}/update_weights failed ({resp.status_code}): {resp.text}")
        return resp.json()
