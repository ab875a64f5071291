"""Rollout-scoped OpenAI endpoints: an agent program talks to the policy as to any OpenAI server, and each of
its calls is recorded in token ids for training.

``POST /rollouts`` (an admin route) opens a rollout and answers its key and base URL, ``/rollouts/KEY/v1``.
Under it, ``POST .../chat/completions`` is the sidecar's own chat route (streaming or not, tool calls as the
backend parses them) with three changes: the model is the served policy whatever name the agent asks for, the
answer also carries the prompt's and the completion's token ids (vLLM's ``return_token_ids``) and the sampled
tokens' logprobs (asyncrl's compact form, unless the agent asked for logprobs itself), and the call is
appended to the rollout's record before its last byte is sent, so a call the agent has seen answered is
always in the record. ``GET .../models`` lists the policy. ``DELETE /rollouts/KEY`` (admin) ends the rollout
and answers its calls in order; a call to a rollout that ended or never opened gets a 404 that says which.

This is ASGI middleware in front of either backend's app (built-in or vLLM), so both serve it through their
own chat handler: no second implementation of templates, tool parsing or streaming. What it adds per call is
one JSON rewrite of the request and one parse of the answer (``python benchmarks/agent_capture.py`` measures
it). A rollout lives on the sidecar that opened it: its agent's calls all go there, so its record is whole;
one never ended (its runner died) is dropped ``ttl_s`` after it opened.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter

from asyncrl.inference.asgi import Replay, TooLarge, at_path, read_body
from asyncrl.inference.errors import BadRequest, error_response
from asyncrl.inference.protocol import OpenRollout, refused_fields
from asyncrl.rollouts.answers import LOGPROBS_ENCODING, LOGPROBS_ENCODING_FIELD, logprob_values

PREFIX = "/rollouts/"
ENDED_MEMORY = 65_536  # ended rollouts remembered, so a late call is told "ended" rather than "unknown"
# rollouts open at once: past it, opening one more is a 409 (a runner that never ends them)
OPEN_LIMIT = 65_536


@dataclass
class Record:
    opened: float
    ttl_s: float
    sampling: dict[str, Any] = field(default_factory=dict)  # imposed on every call (max_tokens: at most)
    seed: int | None = None  # call k, if unseeded, samples with seed + k
    calls: list[dict[str, Any]] = field(default_factory=list)
    unusable: int = 0  # calls answered without token ids or logprobs for every sampled token (not trainable)
    sent: int = 0  # calls sent on to the chat route


class Rollouts:
    """The open rollouts of one sidecar, by key; ``version()``: the policy the sidecar holds (kept with each
    call), which the backend that serves them sets."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.open: dict[str, Record] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # key -> why it ended
        self.clock = clock
        self.version: Callable[[], int] = lambda: 0

    def start(self, ttl_s: float, sampling: dict[str, Any] | None = None, seed: int | None = None) -> str:
        self._expire()
        if len(self.open) >= OPEN_LIMIT:
            raise BadRequest(
                f"{OPEN_LIMIT} rollouts are open on this sidecar: end some (DELETE /rollouts/KEY)", 409
            )
        key = secrets.token_urlsafe(16)
        self.open[key] = Record(self.clock(), ttl_s, dict(sampling or {}), seed)
        return key

    def find(self, key: str) -> Record:
        """The open rollout ``key``, or a 404 that says whether it ended or never opened."""
        record = self.open.get(key)
        if record is not None and self.clock() - record.opened > record.ttl_s:
            self._end(key, f"it expired after its ttl_s={record.ttl_s:g}")
            record = None
        if record is None:
            why = self.ended.get(key)
            message = (
                f"rollout {key!r} has ended ({why})"
                if why
                else f"no rollout {key!r} is open on this sidecar"
            )
            raise BadRequest(message, 404)
        return record

    def finish(self, key: str) -> Record:
        record = self.find(key)
        self._end(key, "its runner ended it")
        return record

    def _end(self, key: str, why: str) -> None:
        self.open.pop(key, None)
        self.ended[key] = why
        while len(self.ended) > ENDED_MEMORY:
            self.ended.popitem(last=False)

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, r in self.open.items() if now - r.opened > r.ttl_s]:
            self._end(key, "it expired")


def rewrite(body: dict[str, Any], served: str, record: Record) -> None:
    """Turn an agent's chat request into one that answers what training needs, sampled as ``record`` says.
    Logprobs the agent asked for itself stay in OpenAI's form, which the record reads as well."""
    if body.get("n") not in (None, 1):
        raise BadRequest(f"n={body['n']!r}: a rollout endpoint samples one completion per call", param="n")
    if refused := refused_fields(body):  # the built-in sidecar refuses them anyway; vLLM would honour them
        raise BadRequest(
            f"{', '.join(refused)}: a rollout samples the policy's own "
            "distribution, which the trainer recomputes "
            "(penalties, biases and constrained decoding sample another); "
            "leave them out or at their defaults",
            param=refused[0],
        )
    body["model"] = served
    imposed = dict(record.sampling)
    if (cap := imposed.pop("max_tokens", None)) is not None:
        wanted = [
            v for k in ("max_completion_tokens", "max_tokens") if isinstance(v := body.pop(k, None), int)
        ]
        body["max_tokens"] = min([cap, *wanted])
    body.update(imposed)
    if record.seed is not None and body.get("seed") is None:
        body["seed"] = (record.seed + record.sent) % 2**63
    record.sent += 1
    body["return_token_ids"] = True
    if not body.get("logprobs"):
        body["logprobs"] = True
        body[LOGPROBS_ENCODING_FIELD] = LOGPROBS_ENCODING


class _Answer:
    """A chat answer as it streams past: the whole body, or server-sent events parsed as they arrive."""

    def __init__(self, streamed: bool):
        self.streamed, self.buffer = streamed, b""
        self.events: list[dict[str, Any]] = []

    def add(self, chunk: bytes) -> None:
        self.buffer += chunk
        if not self.streamed:
            return
        *whole, self.buffer = self.buffer.split(b"\n\n")
        for event in whole:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and (data := line[5:].strip()) != b"[DONE]":
                    self.events.append(json.loads(data))

    def call(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """``(call, reply)``: the recorded call (``None`` if it lacks token ids or a logprob per token) and
        the reply message."""
        try:
            if self.streamed:
                prompt, ids, values, reply, finish, versions = _merge_events(self.events)
            else:
                data = json.loads(self.buffer)
                choice = data["choices"][0]
                prompt, ids, reply = (
                    data.get("prompt_token_ids"),
                    choice.get("token_ids"),
                    choice.get("message") or {},
                )
                finish, versions = choice.get("finish_reason"), choice.get("policy_versions")
                values = logprob_values(choice.get("logprobs") or {}, len(ids or ()))
        except (RuntimeError, ValueError, KeyError, IndexError, TypeError):
            return None, {}
        if prompt is None or not ids or len(values) != len(ids):
            return None, reply
        call = {"prompt_ids": prompt, "completion_ids": ids, "logprobs": values, "finish_reason": finish}
        if versions:
            call["policy_versions"] = versions
        return call, reply


def _merge_events(events: list[dict[str, Any]]) -> tuple:
    """A streamed answer's prompt ids, completion ids, logprobs, reply message, finish reason and token
    versions."""
    prompt, finish = None, None
    ids: list[int] = []
    values: list[float] = []
    content: list[str] = []
    versions: list[int] = []
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        prompt = event.get("prompt_token_ids") or prompt
        for choice in event.get("choices") or ():
            prompt = choice.get("prompt_token_ids") or prompt
            chunk_ids = choice.get("token_ids") or []
            ids.extend(chunk_ids)
            versions.extend(choice.get("policy_versions") or ())
            if lps := choice.get("logprobs"):
                values.extend(logprob_values(lps, len(chunk_ids)))
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or ():
                merged = calls.setdefault(tc.get("index", 0), {"function": {"name": "", "arguments": ""}})
                merged.update({k: v for k, v in tc.items() if k not in ("function", "index")})
                for k, v in (tc.get("function") or {}).items():
                    merged["function"][k] = merged["function"].get(k, "") + (v or "")
            finish = choice.get("finish_reason") or finish
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        reply["tool_calls"] = [calls[i] for i in sorted(calls)]
    return prompt, ids, values, reply, finish, versions


class RolloutEndpoints:
    """ASGI middleware: ``/rollouts/KEY/v1/...`` served by the app's own routes, each chat call recorded in
    the rollout ``KEY`` (see the module's docstring); ``served``: the policy's model name; ``max_bytes``: the
    bound of a request body (``inference.max_body_mb``)."""

    def __init__(self, app, rollouts: Rollouts, served: str, max_bytes: int):
        self.app, self.rollouts, self.served, self.max_bytes = app, rollouts, served, max_bytes

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        key, _, rest = path[len(PREFIX) :].partition("/") if path.startswith(PREFIX) else ("", "", "")
        if not rest:  # another route, or the admin routes of /rollouts themselves
            return await self.app(scope, receive, send)
        try:
            record = self.rollouts.find(key)
            if (scope["method"], rest) == ("GET", "v1/models"):
                return await self.app(at_path(scope, "/v1/models"), receive, send)
            if (scope["method"], rest) != ("POST", "v1/chat/completions"):
                raise BadRequest(
                    f"{scope['method']} {PREFIX}KEY/{rest}: a rollout's endpoint serves POST "
                    "v1/chat/completions and GET v1/models",
                    404,
                )
            body = await read_body(scope, receive, self.max_bytes)
            if body is None:
                return None  # the client went away
            request = _json_object(body)
            if request is None:  # not a JSON object: the chat route says what is wrong with it
                return await self.app(
                    at_path(scope, "/v1/chat/completions", body), Replay(body, receive), send
                )
            rewrite(request, self.served, record)
        except TooLarge:
            return await error_response(f"the request body exceeds {self.max_bytes} bytes", 413)(
                scope, receive, send
            )
        except BadRequest as e:
            return await error_response(e.detail, e.status_code, e.param)(scope, receive, send)
        await self._chat(scope, receive, send, record, request)

    async def _chat(self, scope, receive, send, record: Record, request: dict[str, Any]) -> None:
        body = json.dumps(request, separators=(",", ":")).encode()
        answer, version, status = _Answer(bool(request.get("stream"))), self.rollouts.version(), [0]

        async def relay(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and status[0] == 200:
                answer.add(message.get("body", b""))
                if not message.get("more_body"):  # recorded before the agent can see the answer is complete
                    call, reply = answer.call()
                    if call is None:
                        record.unusable += 1
                    else:
                        extra = {
                            "messages": request.get("messages"),
                            "tools": request.get("tools"),
                            "reply": reply,
                        }
                        record.calls.append({**call, **extra, "version": version})
            await send(message)

        await self.app(at_path(scope, "/v1/chat/completions", body), Replay(body, receive), relay)


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def rollout_router(rollouts: Rollouts) -> APIRouter:
    """``POST /rollouts``, ``GET`` and ``DELETE /rollouts/KEY``:
    :func:`asyncrl.inference.admin_routes.admin_router` serves them to admin callers only."""
    router = APIRouter()

    @router.post("/rollouts")
    async def start(body: OpenRollout) -> dict[str, Any]:
        sampling = body.sampling.model_dump(exclude_none=True) if body.sampling else {}
        key = rollouts.start(body.ttl_s, sampling, body.seed)
        return {"id": key, "base_url": f"{PREFIX}{key}/v1"}

    @router.get("/rollouts/{key}")
    async def peek(key: str) -> dict[str, Any]:
        record = rollouts.find(key)
        return {"id": key, "calls": record.calls, "unusable": record.unusable}

    @router.delete("/rollouts/{key}")
    async def finish(key: str) -> dict[str, Any]:
        record = rollouts.finish(key)
        return {"id": key, "calls": record.calls, "unusable": record.unusable}

    return router
