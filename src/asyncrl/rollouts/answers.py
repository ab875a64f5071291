"""What a chat answer holds for training: each choice's token ids, processed logprobs and (a mixture of
experts, when asked) the experts each token was routed to; and the policy versions its tokens were sampled
under."""

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
# fresh Counter in each group's task, every chat answer adds to it. A server that reports each token's
# version (asyncrl's sidecar: ``policy_versions`` per choice) is counted exactly; otherwise (vLLM) every
# token counts as the version the server held when the request was sent: the oldest it can be, so staleness
# is never under-stated when a weight update lands in the middle of a completion.
TOKEN_VERSIONS: contextvars.ContextVar[Counter | None] = contextvars.ContextVar(
    "token_versions", default=None
)

# asyncrl's compact chat logprobs, asked for per request (both sidecars honour it; a server that ignores the
# field answers OpenAI's per-token objects, which read_chat reads as well): each choice's sampled-token
# logprobs in one base64 array, {"content": null, "base64": ..., "dtype": "<f4" | "<f8"}. OpenAI's form costs
# a Python object, a JSON object and a byte list per token on both sides, which is a large share of a
# sidecar's time per answer at RL batch sizes (`python benchmarks/rollouts.py --help`).
LOGPROBS_ENCODING_FIELD, LOGPROBS_ENCODING = "logprobs_encoding", "base64"
DTYPES = ("<f4", "<f8")


@dataclass
class ChoiceOut:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    # int16 [prompt + completion - 1, MoE layers, top_k], when asked
    routed_experts: np.ndarray | None = None


@dataclass
class ChatOut:
    prompt_ids: list[int]
    choices: list[ChoiceOut]


def read_chat(data: dict[str, Any], url: str, sent_version: int) -> ChatOut:
    """The choices of an OpenAI-style chat answer from ``url`` (in index order), counting their tokens'
    policy versions into :data:`TOKEN_VERSIONS`: the server's own per-token versions where it reports them,
    else the version it held when the request was sent."""
    choices = []
    counts = TOKEN_VERSIONS.get()
    for ch in sorted(data["choices"], key=lambda c: c["index"]):
        # vLLM's, for a request it stopped (paused with mode=abort, shut down)
        if ch.get("finish_reason") == "abort":
            raise RuntimeError(
                f"server {url} aborted the request (finish_reason 'abort'): a cut sample is not trained on"
            )
        if ch.get("token_ids") is None or not ch.get("logprobs"):
            raise RuntimeError(
                f"server {url} returned no token ids/logprobs; it must support "
                "vLLM's return_token_ids and logprobs"
            )
        lps = logprob_values(ch["logprobs"], len(ch["token_ids"]), url)
        routes = routes_array(ch.get("routed_experts"), url)
        choices.append(
            ChoiceOut(ch["token_ids"], lps, ch["message"].get("content") or "", ch["finish_reason"], routes)
        )
        if counts is not None:
            versions = ch.get("policy_versions")
            if isinstance(versions, list) and len(versions) == len(ch["token_ids"]):
                counts.update(versions)
            else:
                counts[sent_version] += len(ch["token_ids"])
    return ChatOut(data.get("prompt_token_ids") or [], choices)


def encode_logprobs(values: np.ndarray) -> dict[str, Any]:
    """A choice's ``logprobs`` in the compact form (:data:`LOGPROBS_ENCODING`): ``values`` (float32 or
    float64) as little-endian bytes, base64; :func:`logprob_values` reads it back to the same numbers."""
    if values.dtype.kind != "f" or values.dtype.itemsize not in (4, 8):
        raise TypeError(f"compact logprobs are float32 or float64, not {values.dtype}")
    little = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    return {
        "content": None,
        "base64": base64.b64encode(little.tobytes()).decode("ascii"),
        "dtype": little.dtype.str,
    }


def logprob_values(logprobs: dict[str, Any], n: int, url: str = "the server") -> list[float]:
    """The ``n`` sampled tokens' logprobs of a chat choice's ``logprobs``: the compact form
    (:func:`encode_logprobs`) or OpenAI's one object per token; an answer with another count is refused by
    name."""
    if logprobs.get("base64") is not None:
        dtype = logprobs.get("dtype")
        if dtype not in DTYPES:
            raise RuntimeError(
                f"server {url} answered compact logprobs of dtype {dtype!r}, not one of {DTYPES}"
            )
        try:
            values = np.frombuffer(base64.b64decode(logprobs["base64"], validate=True), dtype=dtype)
        except (binascii.Error, ValueError, TypeError) as e:
            raise RuntimeError(
                f"server {url} answered compact logprobs that are not base64 {dtype}: {e}"
            ) from e
        lps = values.astype(np.float64).tolist()
    else:
        lps = [c["logprob"] for c in logprobs.get("content") or ()]
    if len(lps) != n:
        raise RuntimeError(f"server {url} answered {len(lps)} logprobs for {n} tokens")
    return lps


def routes_array(value: Any, url: str = "the server") -> np.ndarray | None:
    """A choice's ``routed_experts`` as int16 ``[prompt + completion - 1, layers, top_k]`` expert ids, from
    either sidecar's answer: asyncrl's built-in one answers nested lists; vLLM 0.26 answers base64 ``.npy``
    bytes of a uint8 (up to 256 experts) or uint16 array of that shape, one layer a decoder layer
    (``ChatCompletionResponseChoice.routed_experts``, vllm/entrypoints/openai/chat_completion/protocol.py
    line 112, written by serving.py lines 985-989). ``None`` when the choice has none."""
    if value is None:
        return None
    if not isinstance(value, str):
        return np.asarray(value, dtype=np.int16)
    try:
        # allow_pickle stays off: the bytes come from a server, and a .npy of integers needs none
        routes = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, EOFError) as e:
        raise RuntimeError(
            f"server {url} answered routed_experts that are not a base64 .npy array: {e}"
        ) from e
    if (
        routes.ndim != 3
        or routes.dtype.kind not in "iu"
        or routes.size
        and int(routes.max()) > np.iinfo(np.int16).max
    ):
        raise RuntimeError(
            f"server {url} answered routed_experts of shape {routes.shape} and dtype {routes.dtype}"
        )
    return routes.astype(np.int16)
