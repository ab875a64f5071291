"""``asyncrl_chat``: a verifiers (0.4.0) harness that runs its chat loop in the caller's process.

verifiers' ``null`` harness is the same loop as a program: it starts a Python process per episode segment and
first bootstraps ``uv`` from the network (``runtime.prepare_uv_script``), so it fails offline and costs a
process start per single-turn episode. verifiers' harness contract allows the loop in-process
(``Harness.launch``: "a harness may run its loop in-process ... as long as every model call goes through
``endpoint`` + ``secret``"), which is what this does: each turn is one POST to the rollout's interception
server, which renders the conversation with the TrainClient, calls the sidecar's token route and commits the
sampled ids and logprobs to the trace. An episode costs one loopback round trip per turn plus the model's
time.

Each turn is retried much as the OpenAI SDK retries the ``null`` harness's turns (transport faults, 408, 429,
5xx; ``ATTEMPTS`` in all, exponential backoff; not 409, which the interception server answers when the
rollout has concluded), under one ``Idempotency-Key``: the interception server replays a turn it already
committed, or joins the attempt still in flight, so a lost response never commits a second turn. Why retry at
all: on a loaded machine (2 cores shared by the three processes) a turn's loopback connection can break under
both ends at once (``ReadError`` on the client while the interception server sees the body cut off), and one
attempt would fail the whole episode.

No tools: the model's replies go back to the environment (``agent.interaction`` turns, or the taskset's own
text protocol). Installed with asyncrl; the harness id is ``asyncrl_chat`` (``--env.agent.harness.id
asyncrl_chat`` for ``vf-eval``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    wait_exponential_jitter,
)
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult

log = logging.getLogger("asyncrl.envs")  # beside the episode warnings of asyncrl.envs.vf_env
_CLIENTS: dict[int, httpx.AsyncClient] = {}
ATTEMPTS = 3  # the first and the OpenAI SDK's two retries


def retryable(status: int) -> bool:
    """The OpenAI SDK's retried statuses, less 409: the interception server's "rollout concluded"."""
    return status in (408, 429) or status >= 500


def _client() -> httpx.AsyncClient:
    """One keep-alive client per event loop, shared by every episode of the process."""
    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(id(loop))
    if client is None or client.is_closed:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        client = _CLIENTS[id(loop)] = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0), limits=limits
        )
    return client


async def post_turn(url: str, body: dict, secret: str) -> httpx.Response:
    """POST one turn to the interception server, retried under one idempotency key (see the module's
    docstring). Returns the last response (the caller reads its status); raises the last transport error
    after ``ATTEMPTS``."""
    key = uuid.uuid4().hex
    retrying = AsyncRetrying(
        stop=stop_after_attempt(ATTEMPTS),
        wait=wait_exponential_jitter(multiplier=0.5, max=8.0),
        retry=retry_if_exception_type(httpx.TransportError)
        | retry_if_result(lambda r: retryable(r.status_code)),
        retry_error_callback=_last,
        before_sleep=lambda state: log.warning(
            f"asyncrl_chat: turn attempt {state.attempt_number} of {ATTEMPTS} "
            f"failed ({_why(state)}); retrying"
        ),
    )
    async for attempt in retrying:
        with attempt:
            headers = {
                "Authorization": f"Bearer {secret}",
                "Idempotency-Key": key,
                # the SDKs' retry marker
                "x-stainless-retry-count": str(attempt.retry_state.attempt_number - 1),
            }
            r = await _client().post(url, json=body, headers=headers)
        outcome = attempt.retry_state.outcome
        if outcome is not None and not outcome.failed:  # tenacity's pattern for retrying on a result
            attempt.retry_state.set_result(r)
    return r


def _last(state: RetryCallState) -> httpx.Response:
    """After the last attempt: its response, or its transport error raised."""
    assert state.outcome is not None
    return state.outcome.result()


def _why(state: RetryCallState) -> str:
    assert state.outcome is not None
    if state.outcome.failed:
        e = state.outcome.exception()
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return f"HTTP {state.outcome.result().status_code}"


class AsyncrlChatConfig(HarnessConfig):
    id: str = "asyncrl_chat"


class AsyncrlChatHarness(Harness[AsyncrlChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # Interaction.turn() continues the conversation with the environment's message
    SUPPORTS_MCP = False
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
    ):
        if mcp_urls:
            return ProgramResult(
                1, "", f"harness 'asyncrl_chat' has no tool support; the task wants {sorted(mcp_urls)}"
            )
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(message_to_wire(m) for m in prompt)
        r = await post_turn(
            f"{endpoint}/chat/completions", {"model": ctx.model, "messages": messages}, secret
        )
        # a turn the rollout refused (a @stop, max_turns) is already on the trace; anything else becomes the
        # rollout's HarnessError with this text
        return (
            ProgramResult(0, "", "")
            if r.status_code == 200
            else ProgramResult(1, "", f"HTTP {r.status_code}: {r.text[:2000]}")
        )


__all__ = ["AsyncrlChatHarness"]
