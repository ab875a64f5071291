"""One environment worker process (:class:`asyncrl.workers.pool.EnvWorkers` starts them): it builds its own
copy of every environment from the run's config, then runs the calls the orchestrator sends until the pipe
closes.

A call names a method of an environment (``("env", name, method)``: the environment is never pickled) or is a
picklable function; it runs as the orchestrator's :class:`~asyncrl.workers.threads.Threads` would run it in
its own process: a reward in a reused daemon thread, an episode as a task of this process's event loop.
Answers go back batched, each batch stamped with this process's CPU time. The process exits when the
orchestrator says ``close``, or when its end of the pipe is gone (the orchestrator died): it never outlives
the run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from asyncrl.config.orchestrator import EnvSpec
from asyncrl.envs.base import Environment
from asyncrl.envs.mixture import build_envs
from asyncrl.rewards import killable as reward_pool
from asyncrl.utils.channel import Channel
from asyncrl.utils.process import quiet_libraries
from asyncrl.workers.threads import Threads

log = logging.getLogger("asyncrl.envs")


def resolve(ref: Any, envs: dict[str, Environment]) -> Callable[..., Any]:
    """The callable a call names: an environment's method, or the function sent."""
    if isinstance(ref, tuple):
        _, env, method = ref
        return getattr(envs[env], method)
    return ref


def portable(exc: BaseException) -> Exception:
    """``exc`` if it survives pickling both ways (its type is what the scorer decides by: ScoringUnavailable,
    TimeoutError), else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Server:
    def __init__(self, conn: Connection, envs: dict[str, Environment], threads: int):
        self.envs, self.runner = envs, Threads(threads)
        self.running: dict[int, asyncio.Future] = {}
        self.closed = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.channel = Channel(
            conn, loop, self.on_batch, self.closed.set, lambda: ("cpu", time.process_time())
        )

    def on_batch(self, batch: list) -> None:
        for message in batch:
            if message[0] == "call":
                _, call_id, ref, args, on_loop = message
                try:
                    future = self.runner.submit(resolve(ref, self.envs), args, on_loop)
                except Exception as e:  # an unknown environment or method, a call that is not awaitable
                    self.channel.put(("error", call_id, portable(e)))
                    continue
                self.running[call_id] = future
                future.add_done_callback(functools.partial(self.answer, call_id))
            elif message[0] == "abandon" and (running := self.running.get(message[1])) is not None:
                self.runner.abandon(running)
            elif message[0] == "close":
                self.closed.set()

    def answer(self, call_id: int, future: asyncio.Future) -> None:
        self.running.pop(call_id, None)
        if future.cancelled():
            self.channel.put(("dropped", call_id))
        elif (exc := future.exception()) is not None:
            self.channel.put(("error", call_id, portable(exc)))
        else:
            self.channel.put(("ok", call_id, future.result()))

    async def serve(self) -> None:
        await self.closed.wait()
        for env in self.envs.values():
            try:
                await env.close()
            except Exception:  # closing is best effort: the process ends next
                log.exception(f"env {env.name} failed to close")


def serve(
    conn: Connection,
    specs: dict[str, EnvSpec],
    data_dir: str | Path,
    threads: int,
    parts: int = 1,
    environ: dict[str, str] | None = None,
) -> None:
    """The worker's entry: build the environments (a failure is sent as ``("fatal", traceback)``), each told
    it is one of ``parts`` copies (the most worker processes there may be), then serve. ``environ``: the
    orchestrator's environment when it started the worker (a fork server's children inherit the server's
    instead)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s env-worker[{os.getpid()}] %(levelname)s %(message)s"
    )
    quiet_libraries()  # the environments' own HTTP clients (verifiers' episodes) log every request at INFO
    try:
        envs = build_envs(specs, data_dir)
        for env in envs.values():
            env.share(parts)
        reward_pool.share(parts)  # the math and reasoning-gym scorers' processes, started on first use
        conn.send([("ready",)])  # calls sent before this wait in the pipe: the pool routes to ready workers
    except BaseException:  # reported to the orchestrator, which stops the run with it
        conn.send([("fatal", traceback.format_exc())])
        return

    async def main() -> None:
        await _Server(conn, envs, threads).serve()

    asyncio.run(main())
