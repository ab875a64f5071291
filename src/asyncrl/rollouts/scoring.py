"""Scoring untrusted model output: a reward that raises, hangs or returns garbage scores 0 and is counted.

Calls run in daemon threads that are kept and reused (``orchestrator.reward_workers`` of them): a hung reward
cannot be killed, but it must neither block the step nor keep the process alive at exit, as a
ThreadPoolExecutor's workers would. A worker whose call is past its deadline is abandoned, and another is
started in its place, so hung rewards never shrink the pool. Reusing threads matters at scale: a thread per
call makes the event loop wait for each new thread to start, which adds up with thousands of groups in flight
(``python benchmarks/orchestrator_scale.py --inflight 4096``).

A failure of what a reward runs on (:class:`asyncrl.utils.errors.ScoringUnavailable`, e.g. a sandbox that cannot
start) is not the completion's: it is retried, then stops the run with the cause, instead of scoring 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from asyncrl.utils.errors import ScoringUnavailable

log = logging.getLogger(__name__)

# a reward whose infrastructure failed is tried this many more times, after 0.5 s, then 1 s: long enough for a
# sandbox that failed to start under a momentary shortage (processes, memory) to start on the next try
RETRIES = 2
RETRY_WAIT_S = 0.5


class _Call:
    """One reward call, handed to a worker thread; ``abandoned`` once its caller gave up on it."""

    __slots__ = ("fn", "example", "completion", "loop", "future", "abandoned")

    def __init__(self, fn, example, completion, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.fn, self.example, self.completion = fn, example, completion
        self.loop, self.future = loop, future
        self.abandoned = False


def _worker(calls: queue.SimpleQueue) -> None:
    """Run calls until one of them is abandoned (its thread was replaced; this one is done when it returns)."""
    while True:
        call = calls.get()
        try:
            result: Any = call.fn(call.example, call.completion)
            exc = None
        except BaseException as e:  # reward code is untrusted: any failure scores 0
            result, exc = None, e
        try:
            call.loop.call_soon_threadsafe(_settle, call.future, result, exc)
        except RuntimeError:  # the loop is closed: the run is over
            return
        if call.abandoned:
            return


class Scorer:
    def __init__(self, workers: int, timeout_s: float):
        self.limit = asyncio.Semaphore(workers)
        self.timeout_s = timeout_s
        self.errors = 0
        self.timeouts = 0
        self.episode_errors = 0  # multi-turn episodes that failed outside their reward (the env's code, a turn)
        self.seconds = 0.0  # the rewards' wall time, summed over calls (they run in threads, beside generation)
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = 0  # started lazily, up to ``workers``: the limit keeps at most that many calls running
        self.workers = workers

    def _start_worker(self) -> None:
        threading.Thread(target=_worker, args=(self.calls,), daemon=True, name="reward").start()
        self.threads += 1

    async def score(self, fn: Callable[[dict, str], float], example: dict[str, Any], completion: str) -> float:
        """``fn``'s reward, 0 (counted) when it raises, hangs or returns no number. When what it runs on fails
        (:class:`ScoringUnavailable`: a sandbox that cannot start), it is tried again up to :data:`RETRIES` times,
        then the error stops the run: scoring such samples 0 would train on zeros."""
        start = time.monotonic()
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(ScoringUnavailable),
                stop=stop_after_attempt(1 + RETRIES),
                wait=wait_exponential(multiplier=RETRY_WAIT_S, max=10 * RETRY_WAIT_S),
                before_sleep=lambda state: log.warning(
                    f"a reward's infrastructure failed ({state.outcome and state.outcome.exception()}); trying again"
                ),
                reraise=True,
            ):
                with attempt:
                    return await self._score(fn, example, completion)
        except ScoringUnavailable as e:
            raise ScoringUnavailable(
                f"a reward could not be scored {1 + RETRIES} times: {e}\nThe run stops rather than train on zeros; "
                "fix the cause above and resume the run (ckpt.resume=latest)"
            ) from e
        finally:
            self.seconds += time.monotonic() - start
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def _score(self, fn: Callable[[dict, str], float], example: dict[str, Any], completion: str) -> float:
        async with self.limit:
            if self.threads < self.workers:
                self._start_worker()
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            call = _Call(fn, example, completion, loop, future)
            self.calls.put(call)
            done, _ = await asyncio.wait({future}, timeout=self.timeout_s)
            if not done:
                call.abandoned = True  # its thread ends when (if) the call returns; this one takes its place
                self._start_worker()
                future.cancel()  # the thread's late result is then dropped by _settle
                self.timeouts += 1
                log.warning(f"reward timed out after {self.timeout_s}s; scoring 0")
                return 0.0
            try:
                value = future.result()
            except ScoringUnavailable:
                raise  # not the completion's fault: score() retries it, then stops the run
            except TimeoutError as e:  # the reward's own deadline (a scoring process killed: asyncrl.rewards)
                self.timeouts += 1
                log.warning(f"reward timed out ({e or 'its own deadline'}); scoring 0")
                return 0.0
            except Exception as e:
                self.errors += 1
                log.warning(f"reward raised {type(e).__name__}: {e}; scoring 0")
                return 0.0
        try:
            value = float(value)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            self.errors += 1
            log.warning("reward returned a non-finite or non-numeric value; scoring 0")
            return 0.0
        return value

    def take_counts(self) -> dict[str, int]:
        counts = {"rollout/reward_errors": self.errors, "rollout/reward_timeouts": self.timeouts}
        if self.episode_errors:
            counts["rollout/episode_errors"] = self.episode_errors
        self.errors = self.timeouts = self.episode_errors = 0
        return counts

    def take_seconds(self) -> float:
        """The rewards' wall time summed over the calls since the last time (a timing, kept out of the counts that
        results such as an eval's metrics.json record)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # timed out already
        return
    if exc is not None:
        future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
    else:
        future.set_result(result)
