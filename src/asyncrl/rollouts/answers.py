"""What a chat answer holds for training: each choice's token ids, processed logprobs and (a mixture of experts,
when asked) the experts each token was routed to; and the policy versions its tokens were sampled under."""

from __future__ import annotations

import base64
import binascii
import contextvars
import io
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

# Tokens generated per policy version by the requests of the current episode group: the orchestrator sets a
# fresh Counter in each group's task, every chat answer adds to it. A server that reports each token's version
# (asyncrl's sidecar: ``policy_versions`` per choice) is counted exactly; otherwise (vLLM) every token counts as
# the version the server held when the request was sent: the oldest it can be, so staleness is never
# under-stated when a weight update lands in the middle of a completion.
TOKEN_VERSIONS: contextvars.ContextVar[Counter | None] = contextvars.ContextVar("token_versions", default=None)


@dataclass
class ChoiceOut:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    routed_experts: np.ndarray | None = None  # int16 [prompt + completion - 1, MoE layers, top_k], when asked


@dataclass
class ChatOut:
    prompt_ids: list[int]
    choices: list[ChoiceOut]


def read_chat(data: dict[str, Any], url: str, sent_version: int) -> ChatOut:
    """The choices of an OpenAI-style chat answer from ``url`` (in index order), counting their tokens' policy
    versions into :data:`TOKEN_VERSIONS`: the server's own per-token versions where it reports them, else the
    version it held when the request was sent."""
    choices = []
    counts = TOKEN_VERSIONS.get()
    for ch in sorted(data["choices"], key=lambda c: c["index"]):
        if ch.get("finish_reason") == "abort":  # vLLM's, for a request it stopped (paused with mode=abort, shut down)
            raise RuntimeError(
                f"server {url} aborted the request (finish_reason 'abort'): a cut sample is not trained on"
            )
        if ch.get("token_ids") is None or not ch.get("logprobs"):
            raise RuntimeError(
                f"server {url} returned no token ids/logprobs; it must support vLLM's return_token_ids and logprobs"
            )
        lps = [c["logprob"] for c in ch["logprobs"]["content"]]
        routes = routes_array(ch.get("routed_experts"), url)
        choices.append(ChoiceOut(ch["token_ids"], lps, ch["message"].get("content") or "", ch["finish_reason"], routes))
        if counts is not None:
            versions = ch.get("policy_versions")
            if isinstance(versions, list) and len(versions) == len(ch["token_ids"]):
                counts.update(versions)
            else:
                counts[sent_version] += len(ch["token_ids"])
    return ChatOut(data.get("prompt_token_ids") or [], choices)


def routes_array(value: Any, url: str = "the server") -> np.ndarray | None:
    """A choice's ``routed_experts`` as int16 ``[prompt + completion - 1, layers, top_k]`` expert ids, from either
    sidecar's answer: asyncrl's built-in one answers nested lists; vLLM 0.26 answers base64 ``.npy`` bytes of a
    uint8 (up to 256 experts) or uint16 array of that shape, one layer a decoder layer
    (``ChatCompletionResponseChoice.routed_experts``, vllm/entrypoints/openai/chat_completion/protocol.py line 112,
    written by serving.py lines 985-989). ``None`` when the choice has none."""
    if value is None:
        return None
    if not isinstance(value, str):
        return np.asarray(value, dtype=np.int16)
    try:
        # allow_pickle stays off: the bytes come from a server, and a .npy of integers needs none
        routes = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, EOFError) as e:
        raise RuntimeError(f"server {url} answered routed_experts that are not a base64 .npy array: {e}") from e
    if routes.ndim != 3 or routes.dtype.kind not in "iu" or routes.size and int(routes.max()) > np.iinfo(np.int16).max:
        raise RuntimeError(f"server {url} answered routed_experts of shape {routes.shape} and dtype {routes.dtype}")
    return routes.astype(np.int16)
