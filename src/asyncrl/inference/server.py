"""The inference sidecar: an OpenAI-compatible HTTP server over a generation engine.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (sampled token ids and logprobs via vLLM's
``return_token_ids``/``logprobs``), ``/v1/models``, ``/health``, and the admin routes
``/update_weights``, ``/pause``, ``/resume``. Requests that arrive together are decoded as one batch by
:class:`Batcher`; the engine runs in one worker thread so the event loop keeps answering. Every
malformed request gets a 400 with the reason, OpenAI-style; admin routes answer only loopback clients
unless a bearer ``admin_token`` is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from asyncrl.config.sections import InferenceConfig
from asyncrl.inference.admin import admin_refusal, weights_problem
from asyncrl.inference.engine import Completion, GenRequest, HFEngine
from asyncrl.inference.protocol import ChatRequest, CompletionRequest, UpdateWeightsRequest


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


class Batcher:
    """Collects concurrent requests into batches for the engine; pausing stops new batches."""

    def __init__(self, engine: HFEngine, cfg: InferenceConfig):
        self.engine, self.cfg = engine, cfg
        self.queue: asyncio.Queue = asyncio.Queue()
        self.running = asyncio.Event()
        self.running.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.stats = {"batches": 0, "requests": 0, "sequences": 0}

    async def submit(self, requests: list[GenRequest]) -> list[list[Completion]]:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((requests, future))
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            await self.running.wait()
            if self.cfg.batch_wait_ms:
                await asyncio.sleep(self.cfg.batch_wait_ms / 1000)
            items, rows = [first], sum(r.n for r in first[0])
            while not self.queue.empty() and rows < self.cfg.max_batch_size:
                item = self.queue.get_nowait()
                items.append(item)
                rows += sum(r.n for r in item[0])
            flat = [r for reqs, _ in items for r in reqs]
            self.stats["batches"] += 1
            self.stats["requests"] += len(items)
            self.stats["sequences"] += rows
            self.idle.clear()
            try:
                outputs = await loop.run_in_executor(self.executor, self.engine.generate, flat)
            except Exception as e:  # an engine failure fails these requests, not the server
                for _, fut in items:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            finally:
                self.idle.set()
            at = 0
            for reqs, fut in items:
                if not fut.done():
                    fut.set_result(outputs[at : at + len(reqs)])
                at += len(reqs)

    async def pause(self) -> None:
        self.running.clear()
        await self.idle.wait()  # the batch in flight finishes; nothing new starts


def build_app(engine: HFEngine, cfg: InferenceConfig) -> FastAPI:
    batcher = Batcher(engine, cfg)
    served = engine.model_name

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="asyncrl inference sidecar", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        return error_response(f"{loc}: {msg}" if loc else msg, 400, loc or None)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(str(exc), exc.status, exc.param)

    def admin(request: Request) -> None:
        refusal = admin_refusal(
            request.client.host if request.client else None, request.headers.get("authorization"), cfg.admin_token
        )
        if refusal:
            raise BadRequest(refusal, 403)

    def check_model(name: str | None) -> None:
        if name not in (None, "", served):
            raise BadRequest(f"The model `{name}` does not exist; this server serves `{served}`", 404, "model")

    def gen_request(prompt_ids: list[int], body, max_tokens: int, top_logprobs: int) -> GenRequest:
        req = GenRequest(
            prompt_ids,
            body.n,
            max_tokens,
            body.temperature,
            body.top_p,
            body.seed,
            body.stop_list(),
            list(body.stop_token_ids or []),
            top_logprobs,
        )
        reason = engine.check(req)
        if reason:
            raise BadRequest(reason)
        return req

    def token_str(tid: int, as_ids: bool) -> str:
        return f"token_id:{tid}" if as_ids else engine.tokenizer.decode([tid])

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "version": engine.version,
            "paused": not batcher.running.is_set(),
            "stats": batcher.stats,
        }

    @app.get("/policy")
    async def policy() -> dict[str, Any]:
        return {"version": engine.version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served,
                    "object": "model",
                    "owned_by": "asyncrl",
                    "max_model_len": engine.max_model_len,
                    "policy_version": engine.version,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> JSONResponse:
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may reject role orders; that is the caller's input
            raise BadRequest(f"cannot apply the chat template: {e}", param="messages") from None
        prompt_ids = engine.tokenizer(text, add_special_tokens=False).input_ids
        max_tokens = body.max_completion_tokens or body.max_tokens or (engine.max_model_len - len(prompt_ids))
        req = gen_request(prompt_ids, body, max_tokens, body.top_logprobs or 0)
        (completions,) = await batcher.submit([req])
        choices = []
        for i, c in enumerate(completions):
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
                "logprobs": None,
            }
            if body.logprobs:
                as_ids = body.return_tokens_as_token_ids
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": token_str(t, as_ids),
                            "logprob": lp,
                            "bytes": None,
                            "top_logprobs": [
                                {"token": token_str(tt, as_ids), "logprob": tl, "bytes": None} for tt, tl in top
                            ],
                        }
                        for t, lp, top in zip(
                            c.token_ids, c.logprobs, c.top_logprobs or [[]] * len(c.token_ids), strict=True
                        )
                    ]
                }
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        response = _envelope("chat.completion", served, choices, [prompt_ids], completions, engine.version)
        if body.return_token_ids:
            response["prompt_token_ids"] = prompt_ids
        return JSONResponse(response)  # plain JSON: FastAPI's jsonable_encoder is slow on large logprob lists

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> JSONResponse:
        check_model(body.model)
        prompts = [p if isinstance(p, list) else engine.tokenizer(p).input_ids for p in body.prompts()]
        # max_tokens=null: the rest of the context, as vLLM does
        reqs = [
            gen_request(p, body, body.max_tokens or engine.max_model_len - len(p), body.logprobs or 0) for p in prompts
        ]
        outputs = await batcher.submit(reqs)
        choices = []
        for p_idx, (prompt_ids, comps) in enumerate(zip(prompts, outputs, strict=True)):
            for j, c in enumerate(comps):
                choice: dict[str, Any] = {
                    "index": p_idx * body.n + j,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                }
                if body.logprobs is not None:
                    as_ids = body.return_tokens_as_token_ids
                    choice["logprobs"] = {
                        "tokens": [token_str(t, as_ids) for t in c.token_ids],
                        "token_logprobs": c.logprobs,
                        "top_logprobs": [{token_str(t, as_ids): lp for t, lp in top} for top in c.top_logprobs] or None,
                        "text_offset": None,
                    }
                if body.return_token_ids:
                    choice["token_ids"], choice["prompt_token_ids"] = c.token_ids, prompt_ids
                choices.append(choice)
        flat = [c for comps in outputs for c in comps]
        return JSONResponse(_envelope("text_completion", served, choices, prompts, flat, engine.version))

    @app.post("/update_weights", dependencies=[Depends(admin)])
    async def update_weights(body: UpdateWeightsRequest) -> dict[str, Any]:
        path = Path(body.path)
        if problem := weights_problem(path):
            raise BadRequest(problem[1], problem[0], "path")
        start = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(batcher.executor, engine.load_weights, path, body.version)
        except (OSError, ValueError, RuntimeError) as e:  # wrong, unreadable or damaged files: the caller's weights
            raise BadRequest(f"cannot load weights from {path}: {e}", param="path") from None
        return {"version": engine.version, "seconds": time.perf_counter() - start}

    @app.post("/pause", dependencies=[Depends(admin)])
    async def pause() -> dict[str, Any]:
        await batcher.pause()
        return {"paused": True}

    @app.post("/resume", dependencies=[Depends(admin)])
    async def resume() -> dict[str, Any]:
        batcher.running.set()
        return {"paused": False}

    return app


def _envelope(kind: str, model: str, choices: list, prompts: list, completions: list[Completion], version: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
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
