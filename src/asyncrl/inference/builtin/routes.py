"""The OpenAI-compatible and token-in routes, as the built-in backend serves them (vLLM serves its own).

``/v1/completions``, ``/v1/chat/completions`` (sampled token ids and logprobs via vLLM's
``return_token_ids``/ ``logprobs``; ``stream=true`` as server-sent events), vLLM's token-in/token-out
``/inference/v1/generate`` (what verifiers' TrainClient calls), ``/v1/models`` (with ``max_model_len``) and
``/health``. Each route reads what it serves from the app's :class:`Sidecar` (``app.state.sidecar``, set by
:func:`asyncrl.inference.builtin.server.build_app`).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.builtin import rendering
from asyncrl.inference.builtin.batcher import Batcher
from asyncrl.inference.builtin.engine import GenRequest
from asyncrl.inference.builtin.engine_process import EngineClient
from asyncrl.inference.builtin.limits import check_size
from asyncrl.inference.builtin.streaming import stream_events
from asyncrl.inference.errors import BadRequest
from asyncrl.inference.protocol import ChatRequest, CompletionRequest, GenerateRequest
from asyncrl.models.tool_calls import render_chat

router = APIRouter()


@dataclass
class Sidecar:
    """What the routes serve from: the engine, the batcher that feeds it, and the limits of ``cfg``.

    Templates and tokenizers take milliseconds per request, and rendering a large logprob list takes longer:
    on the event loop, a burst of requests would delay every other answer (``/health`` included;
    ``python benchmarks/sidecar_load.py --help`` measures it). They run on ``tokenizing``, one thread, since
    tokenizers are not all safe to call from several at once."""

    engine: EngineClient
    batcher: Batcher
    cfg: InferenceConfig
    tokenizing: ThreadPoolExecutor

    async def off_loop(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn)

    async def answer(self, render: Callable[[], dict], stream: bool | None = None) -> Response:
        """``render()``'s body as plain JSON, off the loop (FastAPI's jsonable_encoder is slow on large
        logprob lists); ``stream`` not None: the same response cut into server-sent events (with a usage
        chunk if true)."""
        if stream is not None:
            events = await self.off_loop(lambda: stream_events(render(), include_usage=stream))
            return StreamingResponse(iter(events), media_type="text/event-stream")
        body = await self.off_loop(lambda: json.dumps(render(), separators=(",", ":")).encode())
        return Response(body, media_type="application/json")

    def check_model(self, name: str | None) -> None:
        served = self.engine.model_name
        if name not in (None, "", served):
            raise BadRequest(
                f"The model `{name}` does not exist; this server serves `{served}`", 404, "model"
            )

    def check_size(self, texts: list[str], rows: int) -> None:
        check_size(texts, rows, self.cfg.max_request_rows, self.engine.max_model_len)

    def gen_request(
        self, prompt_ids: list[int], body: Any, max_tokens: int, top_logprobs: int
    ) -> GenRequest:
        req = GenRequest(
            prompt_ids,
            n=body.n,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            top_logprobs=top_logprobs,
            top_k=body.top_k,
            min_p=body.min_p,
            routed_experts=body.return_routed_experts,
        )
        if reason := self.engine.check(req):
            raise BadRequest(reason)
        return req


async def sidecar(request: Request) -> Sidecar:
    # async: FastAPI calls a plain ``def`` dependency in its worker threads, one thread hop per request
    # (``/health`` included) that waits for a free worker and for the GIL behind every other request of a
    # burst
    return request.app.state.sidecar


Served = Annotated[Sidecar, Depends(sidecar)]  # a route's parameter: the app's sidecar


def streamed(body: ChatRequest | CompletionRequest) -> bool | None:
    """``None`` for a plain JSON answer; else whether the stream ends with a usage chunk."""
    return bool(body.stream_options and body.stream_options.include_usage) if body.stream else None


@router.get("/health")
async def health(s: Served) -> dict[str, Any]:
    return {
        "status": "ok",
        "version": s.engine.version,
        "paused": not s.batcher.running.is_set(),
        "stats": s.batcher.stats,
    }


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, s: Served) -> dict[str, Any]:
    s.check_model(model_id)
    return {
        "id": s.engine.model_name,
        "object": "model",
        "owned_by": "asyncrl",
        "max_model_len": s.engine.max_model_len,
    }


@router.get("/v1/models")
async def models(s: Served) -> dict[str, Any]:
    entry = {
        "id": s.engine.model_name,
        "object": "model",
        "owned_by": "asyncrl",
        "max_model_len": s.engine.max_model_len,
    }
    return {"object": "list", "data": [{**entry, "policy_version": s.engine.version}]}


def chat_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The prompt's token ids, by the tokenizer's chat template, with ``tools`` (off the loop)."""
    try:
        text = render_chat(tokenizer, messages, tools, generation_prompt=True)
    except Exception as e:  # a template may reject role orders; that is the caller's input
        raise BadRequest(f"cannot apply the chat template: {e}", param="messages") from None
    return tokenizer(text, add_special_tokens=False).input_ids


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, s: Served) -> Response:
    s.check_model(body.model)
    messages = body.chat_messages()
    s.check_size(["".join(m["content"] for m in messages)], body.n)
    tools = [t.model_dump() for t in body.tools] if body.tools else None
    prompt_ids = await s.off_loop(functools.partial(chat_prompt, s.engine.tokenizer, messages, tools))
    max_tokens = body.max_completion_tokens or body.max_tokens or (s.engine.max_model_len - len(prompt_ids))
    req = s.gen_request(prompt_ids, body, max_tokens, body.top_logprobs or 0)
    (completions,) = await s.batcher.submit([req])
    return await s.answer(
        functools.partial(rendering.chat_response, s.engine, body, prompt_ids, completions), streamed(body)
    )


@router.post("/v1/completions")
async def completions(body: CompletionRequest, s: Served) -> Response:
    s.check_model(body.model)
    raw = body.prompts()
    s.check_size([p for p in raw if isinstance(p, str)], len(raw) * body.n)
    tokenizer = s.engine.tokenizer
    prompts = await s.off_loop(lambda: [p if isinstance(p, list) else tokenizer(p).input_ids for p in raw])
    # max_tokens=null: the rest of the context, as vLLM does
    reqs = [
        s.gen_request(p, body, body.max_tokens or s.engine.max_model_len - len(p), body.logprobs or 0)
        for p in prompts
    ]
    outputs = await s.batcher.submit(reqs)
    scored = None
    if body.prompt_logprobs is not None:  # between decode steps, like a weight update
        scored = await asyncio.get_running_loop().run_in_executor(None, s.engine.call, "score", prompts)
    render = functools.partial(rendering.completions_response, s.engine, body, prompts, outputs, scored)
    return await s.answer(render, streamed(body))


@router.post("/inference/v1/generate")
async def generate(body: GenerateRequest, s: Served) -> Response:
    """vLLM's token route: token ids in, sampled token ids with their logprobs out; no chat template, no
    text. verifiers' TrainClient renders each turn to ids itself, so nothing is re-tokenized."""
    s.check_model(body.model)
    sp = body.sampling_params
    s.check_size([], sp.n)
    max_tokens = sp.max_tokens or s.engine.max_model_len - len(body.token_ids)
    req = s.gen_request(body.token_ids, sp, max_tokens, sp.logprobs or 0)
    (completions,) = await s.batcher.submit([req])
    return await s.answer(functools.partial(rendering.generate_response, s.engine, body, completions))
