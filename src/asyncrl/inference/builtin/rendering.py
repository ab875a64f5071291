"""The bodies of the sidecar's answers, from an engine's completions (pure functions, run off the event
loop): OpenAI's chat and text completions with vLLM's extensions, and vLLM's token-route answer."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from asyncrl.inference.builtin.engine import Completion
from asyncrl.inference.protocol import ChatRequest, CompletionRequest, GenerateRequest
from asyncrl.models.tool_calls import parse_tool_calls
from asyncrl.rollouts.answers import encode_logprobs


def token_str(tokenizer: Any, tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else tokenizer.decode([tid])


def chat_logprobs(tokenizer: Any, c: Completion, as_ids: bool) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object of a completion (also what ``/inference/v1/generate`` answers)."""
    tops = c.top_logprobs or [[]] * len(c.token_ids)
    return {
        "content": [
            {
                "token": token_str(tokenizer, t, as_ids),
                "logprob": lp,
                "bytes": None,
                "top_logprobs": [
                    {"token": token_str(tokenizer, tt, as_ids), "logprob": tl, "bytes": None}
                    for tt, tl in top
                ],
            }
            for t, lp, top in zip(c.token_ids, c.logprobs, tops, strict=True)
        ]
    }


def routed(choice: dict[str, Any], c: Completion) -> dict[str, Any]:
    """``choice`` with the experts each token was routed to, when its request asked
    (``return_routed_experts``)."""
    if c.routed_experts is not None:
        choice["routed_experts"] = c.routed_experts.tolist()
    return choice


def envelope(
    kind: str, model: str, choices: list, prompts: list, completions: list[Completion], version: int
) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    prefix = {"chat.completion": "chatcmpl", "text_completion": "cmpl"}.get(kind, "gen")
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "policy_version": version,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def chat_response(
    engine: Any, body: ChatRequest, prompt_ids: list[int], completions: list[Completion]
) -> dict:
    choices = []
    for i, c in enumerate(completions):
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if body.parses_tool_calls():
            request_and_reply = np.asarray([*prompt_ids, -1, *c.token_ids], np.int64).tobytes()
            content, calls = parse_tool_calls(c.text, key=request_and_reply)
            if calls:  # OpenAI's shape: the calls, the text around them (null if none), finish "tool_calls"
                message, finish = (
                    {"role": "assistant", "content": content or None, "tool_calls": calls},
                    "tool_calls",
                )
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
        if body.logprobs and body.logprobs_encoding and not body.top_logprobs:
            # Python floats: exact
            choice["logprobs"] = encode_logprobs(np.asarray(c.logprobs, dtype=np.float64))
        elif body.logprobs:
            choice["logprobs"] = chat_logprobs(engine.tokenizer, c, body.return_tokens_as_token_ids)
        if body.return_token_ids:  # with the policy version of each token (asyncrl's extension)
            choice["token_ids"], choice["policy_versions"] = c.token_ids, c.versions
        choices.append(routed(choice, c))
    response = envelope(
        "chat.completion", engine.model_name, choices, [prompt_ids], completions, engine.version
    )
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt_ids
    return response


def completion_choice(
    tokenizer: Any, body: CompletionRequest, index: int, prompt_ids: list[int], c: Completion, scored: Any
) -> dict[str, Any]:
    """One choice of a text completion; ``scored``: the prompt's token logprobs (``prompt_logprobs``), or
    None."""
    choice: dict[str, Any] = {
        "index": index,
        "text": c.text,
        "finish_reason": c.finish_reason,
        "logprobs": None,
    }
    if body.logprobs is not None:
        as_ids = body.return_tokens_as_token_ids
        choice["logprobs"] = {
            "tokens": [token_str(tokenizer, t, as_ids) for t in c.token_ids],
            "token_logprobs": c.logprobs,
            "top_logprobs": [
                {token_str(tokenizer, t, as_ids): lp for t, lp in top} for top in c.top_logprobs
            ]
            or None,
            "text_offset": None,
        }
    if body.return_token_ids:
        choice["token_ids"], choice["prompt_token_ids"] = c.token_ids, prompt_ids
    if scored is not None:  # vLLM's layout: None for the first token, then {id: logprob entry}
        choice["prompt_logprobs"] = [None] + [
            {str(t): {"logprob": lp, "rank": None, "decoded_token": token_str(tokenizer, t, False)}}
            for t, lp in zip(prompt_ids[1:], scored, strict=True)
        ]
    return routed(choice, c)


def completions_response(
    engine: Any,
    body: CompletionRequest,
    prompts: list[list[int]],
    outputs: list[list[Completion]],
    scored: Any,
) -> dict:
    choices = [
        completion_choice(
            engine.tokenizer,
            body,
            p_idx * body.n + j,
            prompt_ids,
            c,
            None if scored is None else scored[p_idx],
        )
        for p_idx, (prompt_ids, comps) in enumerate(zip(prompts, outputs, strict=True))
        for j, c in enumerate(comps)
    ]
    flat = [c for comps in outputs for c in comps]
    return envelope("text_completion", engine.model_name, choices, prompts, flat, engine.version)


def generate_response(engine: Any, body: GenerateRequest, completions: list[Completion]) -> dict:
    sp = body.sampling_params
    choices = [
        {
            "index": i,
            "token_ids": c.token_ids,
            "policy_versions": c.versions,
            "logprobs": chat_logprobs(engine.tokenizer, c, as_ids=True) if sp.logprobs is not None else None,
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(completions)
    ]
    choices = [routed(choice, c) for choice, c in zip(choices, completions, strict=True)]
    out = envelope("generate", engine.model_name, choices, [body.token_ids], completions, engine.version)
    out["request_id"] = body.request_id or out["id"]
    out["prompt_token_ids"] = body.token_ids
    out["prompt_logprobs"] = out["kv_transfer_params"] = None
    return out
