"""The inference sidecar: an OpenAI-compatible HTTP server over a generation engine.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (sampled token ids and logprobs via vLLM's
``return_token_ids``/``logprobs``; ``stream=true`` as server-sent events), vLLM's token-in/token-out
``/inference/v1/generate`` (what verifiers' TrainClient calls), ``/v1/models`` (with ``max_model_len``),
``/health``, and the admin routes
``/update_weights``, ``/pause``, ``/resume``. Requests that arrive together are decoded as one batch by
:class:`Batcher`; the engine runs in one worker thread so the event loop keeps answering. Every
malformed request gets a 400 with the reason, OpenAI-style; admin routes answer only loopback clients
unless a bearer ``admin_token`` is configured. ``asyncrl serve`` puts the engine in a process of its own
(:mod:`asyncrl.inference.engine_process`); if that process dies the server exits with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.admin import admin_refusal, update_refusal, weights_problem
from asyncrl.inference.engine import Completion, GenRequest, HFEngine
from asyncrl.inference.engine_process import EngineClient, EngineDied, EngineThread
from asyncrl.inference.protocol import ChatRequest, CompletionRequest, GenerateRequest, UpdateWeightsRequest
from asyncrl.inference.streaming import stream_events


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


@dataclass
class _Job:
    """One HTTP request's generation requests, admitted into the running batch a part at a time."""

    requests: list[GenRequest]
    future: asyncio.Future
    results: list[list[Completion] | None] = field(default_factory=list)
    next: int = 0  # the first request not yet admitted
    done: int = 0  # requests whose completions are in

    def __post_init__(self) -> None:
        self.results = [None] * len(self.requests)


class Batcher:
    """Admits requests into the engine's running batch (continuous batching), fairly; pausing stops admissions.

    The engine decodes up to ``max_batch_size`` sequences at once; requests join between its decode steps
    as soon as there is room, and leave when they finish, so a long completion never holds back new requests
    (one generation request larger than the limit runs alone). Requests are taken round robin, one generation
    request per HTTP request per turn, so a request with hundreds of prompts is admitted in parts between the
    others instead of holding them all behind it.
    """

    def __init__(self, engine: EngineClient, cfg: InferenceConfig):
        self.engine, self.cfg = engine, cfg
        self.pending: deque[_Job] = deque()  # jobs with requests not yet admitted
        self.wakeup = asyncio.Event()  # a new job, or room in the running batch
        self.running = asyncio.Event()
        self.running.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.rows_running = 0  # sequences admitted and not yet finished
        self.stats = {"batches": 0, "requests": 0, "sequences": 0}

    async def submit(self, requests: list[GenRequest]) -> list[list[Completion]]:
        job = _Job(requests, asyncio.get_running_loop().create_future())
        self.stats["requests"] += 1
        self.pending.append(job)
        self.wakeup.set()
        return await job.future

    def take(self, room: int) -> list[tuple[_Job, int]]:
        """The next requests to admit, at most ``room`` sequences (one oversized request when the engine is
        idle): ``(job, index)`` pairs, round robin over the pending jobs."""
        picked: list[tuple[_Job, int]] = []
        rows = 0
        progress = True
        while progress and self.pending:
            progress = False
            for job in list(self.pending):
                n = job.requests[job.next].n
                if rows + n > room and (rows or self.rows_running):
                    continue
                picked.append((job, job.next))
                rows += n
                job.next += 1
                progress = True
                if job.next == len(job.requests):
                    self.pending.remove(job)
                if rows >= room:
                    return picked
        return picked

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.wakeup.clear()
            if not self.pending or not self.running.is_set():
                await (self.wakeup.wait() if self.running.is_set() else self.running.wait())
                continue
            if self.cfg.batch_wait_ms and not self.rows_running:  # let a burst arrive together
                await asyncio.sleep(self.cfg.batch_wait_ms / 1000)
            picked = self.take(self.cfg.max_batch_size - self.rows_running)
            if not picked:  # no room until a running job finishes
                await self.wakeup.wait()
                continue
            flat = [job.requests[i] for job, i in picked]
            rows = sum(r.n for r in flat)
            self.stats["batches"] += 1
            self.stats["sequences"] += rows
            self.rows_running += rows
            self.idle.clear()
            future = self.engine.submit(flat)

            def done(f, picked=picked, rows=rows) -> None:  # the engine client's reader thread
                loop.call_soon_threadsafe(self._finished, picked, rows, f)

            future.add_done_callback(done)

    def _finished(self, picked: list[tuple[_Job, int]], rows: int, future) -> None:
        self.rows_running -= rows
        if not self.rows_running:
            self.idle.set()
        self.wakeup.set()
        error = future.exception()
        if error is not None:  # an engine failure fails these requests, not the server
            for job, _ in picked:
                if job in self.pending:
                    self.pending.remove(job)
                if not job.future.done():
                    job.future.set_exception(error)
            return
        for (job, i), out in zip(picked, future.result(), strict=True):
            job.results[i] = out
            job.done += 1
            if job.done == len(job.requests) and not job.future.done():
                job.future.set_result(job.results)

    async def pause(self) -> None:
        self.running.clear()
        await self.idle.wait()  # the admitted requests finish; nothing new starts


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 in OpenAI's error shape before it is
    parsed (by its Content-Length, or once that many bytes of a chunked body have arrived)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = error_response(f"the request body exceeds inference.max_body_mb ({self.max_bytes} bytes)", 413)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await too_big(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await too_big(scope, receive, send)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


ERRORS = {400: "invalid request", 403: "not allowed", 404: "not found", 409: "conflict", 413: "body too large"}


def _openapi_errors(app: FastAPI) -> dict:
    """FastAPI documents a 422 for every route with a body; this server answers 400 (and 403/404/409/413)
    in OpenAI's error shape instead, so the schema says that."""
    schema = FastAPI.openapi(app)
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": "integer"},
                },
            }
        },
    }
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for methods in schema.get("paths", {}).values():
        for op in methods.values():
            op["responses"].pop("422", None)
            for code, what in ERRORS.items():
                op["responses"].setdefault(str(code), {"description": what, **ref})
    app.openapi_schema = schema
    return schema


log = logging.getLogger("asyncrl.inference")


async def _exit_when_dead(engine: EngineClient, every_s: float = 0.5) -> None:
    """A server whose engine died can only fail requests: exit non-zero so the launcher (or compose's restart
    policy) sees it, with the reason in the log."""
    while engine.alive():
        await asyncio.sleep(every_s)
    code = getattr(getattr(engine, "process", None), "exitcode", None)
    # SIGTERM/SIGINT reach the engine when the whole process group is being stopped (the run is ending):
    # not a crash. Any other death, SIGKILL included (the kernel's out-of-memory killer), is one.
    if code is not None and -code in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        log.warning(f"the engine process was stopped by {signal.Signals(-code).name}; stopping the server")
    else:
        how = f" (killed by {signal.Signals(-code).name})" if code is not None and code < 0 else ""
        log.error(f"the engine process died{how}; its traceback, if any, is above in this log. Stopping the server.")
    sys.stderr.flush()
    os._exit(1)


def build_app(engine: HFEngine | EngineClient, cfg: InferenceConfig, roots: list[Path] | None = None) -> FastAPI:
    """The sidecar's app over ``engine`` (an :class:`HFEngine` is driven by a thread of this process);
    ``roots``: where ``/update_weights`` may load from (``None`` = anywhere, for tests and embedding;
    ``asyncrl serve`` passes :func:`asyncrl.inference.admin.weights_roots`)."""
    if isinstance(engine, HFEngine):
        engine = EngineThread(engine)
    batcher = Batcher(engine, cfg)
    served = engine.model_name
    # a prompt longer than this many characters cannot fit the context whatever the tokenizer: refused before
    # it is tokenized (a 50 MB prompt took 19 GB to tokenize)
    max_prompt_chars = engine.max_model_len * 64
    # templates and tokenizers take milliseconds per request: on the event loop, a burst of requests would
    # delay every other answer (/health took 12.7 s during a burst of 1,024). One thread: tokenizers are not
    # all safe to call from several at once.
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def off_loop(fn):
        return await asyncio.get_running_loop().run_in_executor(tokenizing, fn)

    async def json_off_loop(render, stream: bool | None = None) -> Response:
        # plain json, off the loop: FastAPI's jsonable_encoder is slow on large logprob lists, and a batch of
        # 256 finishing at once would otherwise render 256 bodies back to back on the loop
        if stream is not None:  # stream=true: the same response, cut into server-sent events
            events = await off_loop(lambda: stream_events(render(), include_usage=stream))
            return StreamingResponse(iter(events), media_type="text/event-stream")
        body = await off_loop(lambda: json.dumps(render(), separators=(",", ":")).encode())
        return Response(body, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        tasks = [asyncio.create_task(batcher.run()), asyncio.create_task(_exit_when_dead(engine))]
        yield
        for task in tasks:
            task.cancel()

    app = FastAPI(title="asyncrl inference sidecar", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=int(cfg.max_body_mb * 2**20))
    app.openapi = lambda: app.openapi_schema or _openapi_errors(app)  # type: ignore[method-assign]

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown route, wrong method
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:  # a bug here, not the caller's: still JSON
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.exception_handler(EngineDied)
    async def _dead(_: Request, exc: EngineDied) -> JSONResponse:  # the server exits in a moment
        return error_response(str(exc), 503)

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
        refusal = admin_refusal(request.client.host if request.client else None, request.headers, cfg.admin_token)
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

    def chat_logprobs(c: Completion, as_ids: bool) -> dict[str, Any]:
        """OpenAI's chat ``logprobs`` object of a completion (also what ``/inference/v1/generate`` answers)."""
        tops = c.top_logprobs or [[]] * len(c.token_ids)
        return {
            "content": [
                {
                    "token": token_str(t, as_ids),
                    "logprob": lp,
                    "bytes": None,
                    "top_logprobs": [{"token": token_str(tt, as_ids), "logprob": tl, "bytes": None} for tt, tl in top],
                }
                for t, lp, top in zip(c.token_ids, c.logprobs, tops, strict=True)
            ]
        }

    def streamed(body) -> bool | None:
        """``None`` for a plain JSON answer; else whether the stream ends with a usage chunk."""
        return bool(body.stream_options and body.stream_options.include_usage) if body.stream else None

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

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return {"id": served, "object": "model", "owned_by": "asyncrl", "max_model_len": engine.max_model_len}

    def check_size(texts: list[str], rows: int) -> None:
        if rows > cfg.max_request_rows:
            raise BadRequest(
                f"this request asks for {rows} sequences (prompts x n); the limit is "
                f"inference.max_request_rows={cfg.max_request_rows}",
                param="n",
            )
        if (chars := max((len(t) for t in texts), default=0)) > max_prompt_chars:
            raise BadRequest(
                f"a prompt of {chars} characters cannot fit the model's context of {engine.max_model_len} tokens",
                param="prompt",
            )

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
    async def chat(body: ChatRequest) -> Response:
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_size(["".join(m["content"] for m in messages)], body.n)

        def tokenize() -> list[int]:
            try:
                text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # a template may reject role orders; that is the caller's input
                raise BadRequest(f"cannot apply the chat template: {e}", param="messages") from None
            return engine.tokenizer(text, add_special_tokens=False).input_ids

        prompt_ids = await off_loop(tokenize)
        max_tokens = body.max_completion_tokens or body.max_tokens or (engine.max_model_len - len(prompt_ids))
        req = gen_request(prompt_ids, body, max_tokens, body.top_logprobs or 0)
        (completions,) = await batcher.submit([req])

        def render() -> dict[str, Any]:
            choices = []
            for i, c in enumerate(completions):
                choice: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                }
                if body.logprobs:
                    choice["logprobs"] = chat_logprobs(c, body.return_tokens_as_token_ids)
                if body.return_token_ids:  # with the policy version of each token (asyncrl's extension)
                    choice["token_ids"], choice["policy_versions"] = c.token_ids, c.versions
                choices.append(choice)
            response = _envelope("chat.completion", served, choices, [prompt_ids], completions, engine.version)
            if body.return_token_ids:
                response["prompt_token_ids"] = prompt_ids
            return response

        return await json_off_loop(render, streamed(body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        check_model(body.model)
        raw = body.prompts()
        check_size([p for p in raw if isinstance(p, str)], len(raw) * body.n)
        prompts = await off_loop(lambda: [p if isinstance(p, list) else engine.tokenizer(p).input_ids for p in raw])
        # max_tokens=null: the rest of the context, as vLLM does
        reqs = [
            gen_request(p, body, body.max_tokens or engine.max_model_len - len(p), body.logprobs or 0) for p in prompts
        ]
        outputs = await batcher.submit(reqs)
        scored = None
        if body.prompt_logprobs is not None:  # between decode steps, like a weight update
            scored = await asyncio.get_running_loop().run_in_executor(None, engine.call, "score", prompts)

        def render() -> dict[str, Any]:
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
                            "top_logprobs": [{token_str(t, as_ids): lp for t, lp in top} for top in c.top_logprobs]
                            or None,
                            "text_offset": None,
                        }
                    if body.return_token_ids:
                        choice["token_ids"], choice["prompt_token_ids"] = c.token_ids, prompt_ids
                    if scored is not None:  # vLLM's layout: None for the first token, then {id: logprob entry}
                        choice["prompt_logprobs"] = [None] + [
                            {str(t): {"logprob": lp, "rank": None, "decoded_token": token_str(t, False)}}
                            for t, lp in zip(prompt_ids[1:], scored[p_idx], strict=True)
                        ]
                    choices.append(choice)
            flat = [c for comps in outputs for c in comps]
            return _envelope("text_completion", served, choices, prompts, flat, engine.version)

        return await json_off_loop(render, streamed(body))

    @app.post("/inference/v1/generate")
    async def generate(body: GenerateRequest) -> Response:
        """vLLM's token route: token ids in, sampled token ids with their logprobs out; no chat template, no
        text. verifiers' TrainClient renders each turn to ids itself, so nothing is re-tokenized."""
        check_model(body.model)
        sp = body.sampling_params
        check_size([], sp.n)
        req = gen_request(
            body.token_ids, sp, sp.max_tokens or engine.max_model_len - len(body.token_ids), sp.logprobs or 0
        )
        (completions,) = await batcher.submit([req])

        def render() -> dict[str, Any]:
            choices = [
                {
                    "index": i,
                    "token_ids": c.token_ids,
                    "policy_versions": c.versions,
                    "logprobs": chat_logprobs(c, as_ids=True) if sp.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(completions)
            ]
            out = _envelope("generate", served, choices, [body.token_ids], completions, engine.version)
            out["request_id"] = body.request_id or out["id"]
            out["prompt_token_ids"] = body.token_ids
            out["prompt_logprobs"] = out["kv_transfer_params"] = None
            return out

        return await json_off_loop(render)

    updating = asyncio.Lock()  # one update at a time: versions only move forward

    @app.post("/update_weights", dependencies=[Depends(admin)])
    async def update_weights(body: UpdateWeightsRequest) -> dict[str, Any]:
        async with updating:
            return await _update_weights(body)

    async def _update_weights(body: UpdateWeightsRequest) -> dict[str, Any]:
        path = Path(body.path)
        if roots is not None and (refusal := update_refusal(path, body.version, engine.version, roots)):
            raise BadRequest(refusal[1], refusal[0], "path" if refusal[0] == 403 else "version")
        if problem := weights_problem(path):
            raise BadRequest(problem[1], problem[0], "path")
        start = time.perf_counter()
        try:
            # between two decode steps: running completions go on with the new weights (in-flight update)
            await asyncio.get_running_loop().run_in_executor(None, engine.load_weights, path, body.version)
        except EngineDied:
            raise
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
