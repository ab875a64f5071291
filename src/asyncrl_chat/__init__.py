"""``asyncrl_chat``: a verifiers (0.4.0) harness that runs its chat loop in the caller's process.

verifiers' ``null`` harness is the same loop as a program: it starts a Python process per episode segment
and first bootstraps ``uv`` from the network (``runtime.prepare_uv_script``), so it fails offline and costs
~1.7 s per single-turn episode on 2 cores. verifiers' harness contract allows the loop in-process
(``Harness.launch``: "a harness may run its loop in-process ... as long as every model call goes through
``endpoint`` + ``secret``"), which is what this does: each turn is one POST to the rollout's interception
server, which renders the conversation with the TrainClient, calls the sidecar's token route and commits the
sampled ids and logprobs to the trace. ~15 ms per episode plus the model's time.

No tools: the model's replies go back to the environment (``agent.interaction`` turns, or the taskset's own
text protocol). Installed with asyncrl; the harness id is ``asyncrl_chat`` (``--env.agent.harness.id
asyncrl_chat`` for ``vf-eval``).
"""

from __future__ import annotations

import asyncio

import httpx
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult

_CLIENTS: dict[int, httpx.AsyncClient] = {}


def _client() -> httpx.AsyncClient:
    """One keep-alive client per event loop, shared by every episode of the process."""
    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(id(loop))
    if client is None or client.is_closed:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
        client = _CLIENTS[id(loop)] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
    return client


class AsyncrlChatConfig(HarnessConfig):
    id: str = "asyncrl_chat"


class AsyncrlChatHarness(Harness[AsyncrlChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # Interaction.turn() continues the conversation with the environment's message
    SUPPORTS_MCP = False
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
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
        r = await _client().post(
            f"{endpoint}/chat/completions",
            json={"model": ctx.model, "messages": messages},
            headers={"Authorization": f"Bearer {secret}"},
        )
        # a turn the rollout refused (a @stop, max_turns) is already on the trace; anything else becomes the
        # rollout's HarnessError with this text
        return (
            ProgramResult(0, "", "")
            if r.status_code == 200
            else ProgramResult(1, "", f"HTTP {r.status_code}: {r.text[:2000]}")
        )


__all__ = ["AsyncrlChatHarness"]
