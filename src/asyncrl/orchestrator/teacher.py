"""Online distillation (``distill.teacher``): the teacher's logprob of every token the student sampled.

The teacher is a sidecar of its own (``asyncrl serve`` on the teacher model; vLLM or the built-in one), asked
with a prompt-logprobs request: ``POST /v1/completions`` with the episode's token ids as the prompt,
``prompt_logprobs: 0`` and one token to generate. Its answer's ``prompt_logprobs[i]`` is the teacher's
logprob of token ``i`` given the tokens before it, so the completion's slice is what the trainer's reverse-KL
term needs (:func:`asyncrl.trainer.loss.rl_loss`). Teacher and student must share the tokenizer: token ids
are compared, never text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential


def _retryable(e: BaseException) -> bool:
    """Transport errors and 5xx answers are tried again; a 4xx is a bad request and fails at once."""
    if isinstance(e, httpx.HTTPStatusError):
        return e.response.status_code >= 500
    return isinstance(e, httpx.TransportError)


def completion_slice(
    prompt_logprobs: Sequence[Any], token_ids: Sequence[int], prompt_len: int
) -> list[float]:
    """The logprobs of ``token_ids[prompt_len:]`` out of a vLLM-layout ``prompt_logprobs`` answer (pure):
    entry ``i`` maps token ``i``'s id (a string) to ``{"logprob": ...}``; entry 0 is None. Raises
    ``ValueError`` when the answer does not cover the tokens asked about."""
    if len(prompt_logprobs) != len(token_ids):
        raise ValueError(f"the teacher scored {len(prompt_logprobs)} tokens of {len(token_ids)}")
    out = []
    for i in range(prompt_len, len(token_ids)):
        entry = prompt_logprobs[i] or {}
        found = entry.get(str(token_ids[i]))
        if not isinstance(found, dict) or "logprob" not in found:
            raise ValueError(f"the teacher's answer has no logprob for token {i} (id {token_ids[i]})")
        out.append(float(found["logprob"]))
    return out


class Teacher:
    """Client of the teacher sidecar: :meth:`annotate` fills each branch's ``teacher_logprobs``."""

    def __init__(self, url: str, model: str, timeout_s: float, max_concurrency: int, retries: int):
        self.url, self.model, self.retries = url.rstrip("/"), model, retries
        self.client = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)
        self.slots = asyncio.Semaphore(max_concurrency)

    async def logprobs(self, token_ids: list[int], prompt_len: int) -> list[float]:
        """The teacher's logprob of each of ``token_ids[prompt_len:]`` given the tokens before it."""
        body = {
            "model": self.model,
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        async with self.slots:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self.retries + 1),
                wait=wait_exponential(multiplier=0.5, max=8),
                retry=retry_if_exception(_retryable),
                reraise=True,
            ):
                with attempt:
                    r = await self.client.post("/v1/completions", json=body)
                    if r.status_code >= 500:
                        r.raise_for_status()
        if r.status_code != 200:
            raise RuntimeError(
                f"the teacher at {self.url} refused a prompt-logprobs request: "
                f"{r.status_code} {r.text[:300]}"
            )
        return completion_slice(r.json()["choices"][0]["prompt_logprobs"], token_ids, prompt_len)

    async def annotate(self, rollouts: list) -> None:
        """Set ``teacher_logprobs`` on every branch of ``rollouts`` (all requests at once,
        ``max_concurrency`` in flight)."""
        branches = [b for r in rollouts for b in r.branches]
        answers = await asyncio.gather(
            *(self.logprobs(b.prompt_ids + b.completion_ids, len(b.prompt_ids)) for b in branches)
        )
        for b, lps in zip(branches, answers, strict=True):
            b.teacher_logprobs = lps

    async def close(self) -> None:
        await self.client.aclose()
