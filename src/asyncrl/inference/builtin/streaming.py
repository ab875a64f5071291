"""``stream=true``: a finished response re-cut into OpenAI's server-sent-event chunks (pure functions).

The CPU engine decodes a batch at a time and hands back whole completions, so a streamed answer arrives
when its batch is done: one chunk with the role (chat), one with each choice's content and logprobs, one
with each finish reason, then the usage chunk if ``stream_options.include_usage``, then ``data: [DONE]``.
That is the wire format OpenAI clients and verifiers' ``EvalClient`` (which always streams) parse; the
text is the same as without streaming. vLLM streams token by token itself.
"""

from __future__ import annotations

import json
from typing import Any


def _event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def stream_events(full: dict[str, Any], include_usage: bool) -> list[bytes]:
    """The SSE events of ``full`` (a ``chat.completion`` or ``text_completion`` response of this server)."""
    chat = full["object"] == "chat.completion"
    head = {k: full[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    usage = {"usage": None} if include_usage else {}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return _event({**head, "choices": choices, **usage, **extra})

    events = []
    if chat:  # the role first, as OpenAI sends it; vLLM's prompt_token_ids ride on the first chunk
        first = [{"index": c["index"], "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for c in full["choices"]]  # fmt: skip
        extra = {"prompt_token_ids": full["prompt_token_ids"]} if "prompt_token_ids" in full else {}
        events.append(chunk(first, **extra))
    body = []
    for c in full["choices"]:
        part: dict[str, Any] = {"index": c["index"], "logprobs": c["logprobs"], "finish_reason": None}
        if chat:
            part["delta"] = {"content": c["message"]["content"]}
            # whole, in one delta (index: a call's place in the list)
            if calls := c["message"].get("tool_calls"):
                part["delta"]["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        else:
            part["text"] = c["text"]
        for key in ("token_ids", "prompt_token_ids"):  # vLLM's return_token_ids extension
            if key in c:
                part[key] = c[key]
        body.append(part)
    events.append(chunk(body))
    ends = []
    for c in full["choices"]:
        end: dict[str, Any] = {"index": c["index"], "logprobs": None, "finish_reason": c["finish_reason"]}
        if chat:
            end["delta"] = {}
        else:
            end["text"] = ""
        ends.append(end)
    events.append(chunk(ends))
    if include_usage:
        events.append(_event({**head, "choices": [], "usage": full["usage"]}))
    events.append(_event("[DONE]"))
    return events
