"""An agent program's model calls, as a sidecar's rollout-scoped endpoint recorded them
(:mod:`asyncrl.inference.recording`), made into training branches.

A call whose prompt extends an earlier call's whole token stream (its prompt, then its completion) token for
token continues that stream: the tokens in between (a tool's result, the user's next message, the template's
markers) are context, the completion is trained on. That is what an agent that appends to its history
produces, and it trains once on the whole conversation. A call that extends no stream (an agent that rewrote,
summarised or re-templated its history, or a second agent of the same program) starts a stream of its own:
its prompt is context, even where it repeats tokens trained on elsewhere, so no sampled token is trained
twice and none under a prompt it was not sampled from. Each stream is one
:class:`~asyncrl.rollouts.trajectory.Branch`, all sharing the episode's reward.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from asyncrl.rollouts.trajectory import Branch, split_stream

# the variables agent programs and their frameworks read for an OpenAI server: the OpenAI SDK (and so the
# OpenAI Agents SDK, pydantic-ai, langchain-openai), LiteLLM-style tools, and OPENAI_MODEL for programs that
# take a name
ENV_NAMES = {
    "base_url": ("OPENAI_BASE_URL", "OPENAI_API_BASE"),
    "api_key": ("OPENAI_API_KEY",),
    "model": ("OPENAI_MODEL",),
}


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.tokens += ids
        self.sampled += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def assemble(calls: list[dict[str, Any]]) -> tuple[list[Branch], int]:
    """The branches of an episode's recorded ``calls`` (in the order they were answered), and how many calls
    started a stream of their own after the first (re-templated: see the module's docstring)."""
    streams: list[Stream] = []
    restarts = 0
    for call in calls:
        prompt = call["prompt_ids"]
        # the longest stream this prompt extends (a stream extended since cannot be a prefix of an older
        # prompt)
        base = max(
            (s for s in streams if len(s.tokens) <= len(prompt) and prompt[: len(s.tokens)] == s.tokens),
            key=lambda s: len(s.tokens),
            default=None,
        )
        if base is None:
            restarts += bool(streams)
            base = Stream()
            streams.append(base)
        base.add(prompt[len(base.tokens) :], None)
        base.add(call["completion_ids"], call["logprobs"])
    branches = [b for s in streams if (b := split_stream(s.tokens, s.sampled, s.logprobs)) is not None]
    return branches, restarts


@dataclass
class Endpoint:
    """A rollout's own OpenAI endpoint: what an agent program is given."""

    base_url: str  # ends in /v1, as OpenAI clients take it
    api_key: str
    model: str

    def env(self) -> dict[str, str]:
        """The environment variables that point agent programs and their frameworks at this endpoint."""
        return {name: getattr(self, key) for key, names in ENV_NAMES.items() for name in names}


@dataclass
class Recorded:
    calls: list[dict[str, Any]] = field(default_factory=list)
    unusable: int = 0  # calls answered without a logprob for every sampled token (not trainable)


@contextlib.asynccontextmanager
async def recorded_rollout(
    http: httpx.AsyncClient, url: str, model: str, ttl_s: float, sampling: dict[str, Any], seed: int | None
) -> AsyncIterator[tuple[Endpoint, Recorded]]:
    """Open a rollout-scoped endpoint on the sidecar at ``url``, every call sampled with ``sampling`` (and
    seeded from ``seed`` if given); on exit, end it and fill the :class:`Recorded` with its calls (``ttl_s``:
    when the sidecar drops it if this process dies first)."""
    body = {"ttl_s": ttl_s, "sampling": sampling, "seed": seed}
    opened = (await http.post(f"{url}/rollouts", json=body)).raise_for_status().json()
    recorded = Recorded()
    try:
        yield Endpoint(f"{url}{opened['base_url']}", "asyncrl-rollout", model), recorded
    finally:
        ended = (await http.delete(f"{url}/rollouts/{opened['id']}")).raise_for_status().json()
        recorded.calls, recorded.unusable = ended["calls"], ended["unusable"]
