"""Where the environments' code runs: the :class:`Runner` interface, and :class:`Threads`, the runner of one
process.

The :class:`~asyncrl.workers.scoring.Scorer` hands every call of an environment's code (a reward, an episode)
to a runner chosen once at start: :class:`Threads` runs it in this process, and
:class:`asyncrl.workers.pool.EnvWorkers` in a pool of worker processes (which run a :class:`Threads` each).

Two kinds of call. A plain call (a reward) runs in a daemon thread that is kept and reused: a hung reward
cannot be killed, but it must neither block the step nor keep the process alive at exit, as a
ThreadPoolExecutor's workers would. A call whose deadline passed is abandoned and another thread is started
in its place, so hung rewards never shrink the pool. Reusing threads matters at scale: a thread per call
makes the event loop wait for each new thread to start, which adds up with thousands of groups in flight
(``python benchmarks/orchestrator_scale.py --inflight 4096``). A reward written as ``async def`` runs on an
event loop of its own in its thread, so a synchronous call inside it blocks only itself. A call ``on_loop``
(an episode, which shares its environment's servers and sessions with the other episodes) runs as a task on
the runner's event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol


class WorkerLost(RuntimeError):
    """The process running a call died (a reward that crashed it, the kernel's OOM killer): the call may be
    sent again; the pool has started another process in its place."""


class Runner(Protocol):
    capacity: int  # calls it runs at once without queueing them (the scorer's limit)

    def submit(self, fn: Callable[..., Any], args: tuple, on_loop: bool) -> asyncio.Future:
        """Start ``fn(*args)``; its result (or exception) on the running loop's future."""
        ...

    def abandon(self, future: asyncio.Future) -> None:
        """The caller gave up on the call at its deadline: drop its result and free what it holds."""
        ...

    async def started(self, future: asyncio.Future) -> None:
        """Return once the call behind ``future`` has reached what runs it (a worker process that has built
        its environments), or has ended: a call's deadline is the call's own, not its worker's start-up."""
        ...

    def take_stats(self) -> dict[str, float]:
        """The runner's metrics since the last time (worker processes, their CPU); timings, not results."""
        ...

    async def close(self) -> None: ...


class _Call:
    """One plain call, handed to a worker thread; ``abandoned`` once its caller gave up on it."""

    __slots__ = ("fn", "args", "loop", "future", "abandoned")

    def __init__(self, fn, args: tuple, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.fn, self.args, self.loop, self.future = fn, args, loop, future
        self.abandoned = False


def _worker(calls: queue.SimpleQueue) -> None:
    """Run calls until one of them is abandoned (its thread was replaced; this one is done when it
    returns)."""
    while True:
        call = calls.get()
        try:
            result: Any = call.fn(*call.args)
            if inspect.iscoroutine(result):  # an `async def` reward: a loop of its own, in this thread
                result = asyncio.run(result)
            exc = None
        except BaseException as e:  # environment code is untrusted: the caller decides what a failure means
            result, exc = None, e
        try:
            call.loop.call_soon_threadsafe(_settle, call.future, result, exc)
        except RuntimeError:  # the loop is closed: the run is over
            return
        if call.abandoned:
            return


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # abandoned or cancelled already
        return
    if exc is not None:
        future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
    else:
        future.set_result(result)


class Threads:
    """Implements :class:`Runner` in this process: plain calls in up to ``threads`` reused daemon threads
    (started lazily; more queue), calls ``on_loop`` as tasks of the running loop."""

    def __init__(self, threads: int):
        self.capacity = threads
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = 0
        self.running: dict[asyncio.Future, _Call] = {}

    def _start_thread(self) -> None:
        threading.Thread(target=_worker, args=(self.calls,), daemon=True, name="reward").start()
        self.threads += 1

    def submit(self, fn: Callable[..., Any], args: tuple, on_loop: bool) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if on_loop:
            return loop.create_task(fn(*args))
        if self.threads < self.capacity:
            self._start_thread()
        future = loop.create_future()
        call = _Call(fn, args, loop, future)
        self.running[future] = call
        future.add_done_callback(self.running.pop)
        self.calls.put(call)
        return future

    def abandon(self, future: asyncio.Future) -> None:
        call = self.running.get(future)
        if call is not None:
            call.abandoned = True  # its thread ends when (if) the call returns; a new one takes its place
            self._start_thread()
        future.cancel()  # a late result is then dropped by _settle; a task is cancelled

    async def started(self, future: asyncio.Future) -> None:
        return None

    def take_stats(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None  # daemon threads: a hung one does not keep the process alive
