"""Continuous batching for the built-in engine: which requests join its running batch, and when.

Requests that arrive together are decoded as one batch; the engine runs in its own process or thread
(:mod:`asyncrl.inference.builtin.engine_process`), so the event loop keeps answering while it decodes.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from dataclasses import dataclass, field

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.builtin.engine import Completion, GenRequest
from asyncrl.inference.builtin.engine_process import EngineClient


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
    """Admits requests into the engine's running batch (continuous batching), fairly; pausing stops
    admissions.

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
            self.engine.submit(flat).add_done_callback(
                functools.partial(self._hand_over, loop, picked, rows)
            )

    def _hand_over(
        self, loop: asyncio.AbstractEventLoop, picked: list[tuple[_Job, int]], rows: int, future
    ) -> None:
        """The engine client's reader thread: hands a finished batch to the event loop."""
        loop.call_soon_threadsafe(self._finished, picked, rows, future)

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
