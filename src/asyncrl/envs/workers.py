"""Environments in worker processes: :class:`EnvWorkers`, the :class:`~asyncrl.rollouts.runners.Runner` that runs
rewards and episodes in a pool of processes (:mod:`asyncrl.envs.worker`), so a reward that blocks or crashes
stalls or kills its worker, never the orchestrator's event loop.

What crosses: a call of an environment's method, named (environment, method) since each worker builds its own
copy of the environments from the run's config, with its arguments (an example and a completion; an episode's
example, sidecar URL and sampling settings); and its result (a number; a
:class:`~asyncrl.rollouts.trajectory.Rollout`). Generation stays in the orchestrator's client; a verifiers episode,
whose own client calls the sidecars, runs whole in a worker, on the sidecar the orchestrator picked.

The pool starts ``min`` workers and sends each call to the one with the fewest in flight; while every one has
``threads`` calls in flight (its reward threads are busy, or an episode blocked its loop) another is started, up to
``max``. A worker's start-up (a fresh interpreter, imports, the environments) never counts against a call's deadline:
calls sent to a worker still starting wait in its pipe, and the scorer starts the clock once the worker says it is
up (:meth:`EnvWorkers.started`). A worker that dies
is replaced; the calls it held fail with :class:`~asyncrl.rollouts.runners.WorkerLost`, which the scorer sends again
(bounded) and then counts.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import itertools
import logging
import multiprocessing
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.config.orchestrator import EnvSpec, OrchestratorConfig
from asyncrl.envs.base import Environment
from asyncrl.envs.worker import serve
from asyncrl.rollouts.runners import Runner, Threads, WorkerLost
from asyncrl.utils.channel import Channel
from asyncrl.utils.errors import ScoringUnavailable

log = logging.getLogger("asyncrl.envs")

# spawn: a fresh interpreter (forking the orchestrator, with its threads, event loop and sockets, is unsafe), which
# takes this process's sys.path, so environments on PYTHONPATH or added by a test import there too
_CONTEXT = multiprocessing.get_context("spawn")
# a worker imports asyncrl and builds every environment (verifiers' imports take seconds on a busy machine)
START_S = 300.0


class _Worker:
    def __init__(self, specs: dict[str, EnvSpec], data_dir: str, threads: int, parts: int):
        self.conn, child = _CONTEXT.Pipe()
        # not daemonic: a worker may start processes of its own (the math rewards' pool, the sandbox)
        args = (child, specs, data_dir, threads, parts)
        self.process = _CONTEXT.Process(target=serve, args=args, name="env-worker")
        self.process.start()
        child.close()
        self.inflight = 0
        self.up = asyncio.Event()  # set once its environments are built: calls sent to it start at once
        self.cpu_s = self.cpu_taken = 0.0
        self.fatal: str | None = None
        self.channel: Channel | None = None


class EnvWorkers:
    """Implements :class:`~asyncrl.rollouts.runners.Runner` with ``min_workers`` to ``max_workers`` processes of
    ``threads`` reward threads each, holding the environments of ``specs`` (built from ``data_dir``)."""

    def __init__(
        self, specs: dict[str, EnvSpec], data_dir: str | Path, min_workers: int, max_workers: int, threads: int
    ):
        assert 0 <= min_workers <= max_workers and max_workers >= 1 and threads >= 1
        self.specs, self.data_dir, self.threads = dict(specs), str(data_dir), threads
        self.min, self.max = min_workers, max_workers
        self.capacity = threads * max_workers
        self.workers: list[_Worker] = []
        self.pending: dict[int, tuple[asyncio.Future, _Worker]] = {}
        self.ids: dict[asyncio.Future, int] = {}
        self.next_id = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.restarts = 0
        self.cpu_s = 0.0  # of the workers that are gone
        self.closing = False
        for _ in range(min_workers):  # started now: they import and build the environments while the run starts
            self.workers.append(_Worker(self.specs, self.data_dir, threads, max_workers))
        atexit.register(self._kill)

    # -- calls ----------------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], args: tuple, on_loop: bool) -> asyncio.Future:
        loop = self._bind()
        future = loop.create_future()
        ref = self._ref(fn)
        worker = min(self.workers, key=lambda w: w.inflight, default=None)
        if worker is None or (worker.inflight >= self.threads and len(self.workers) < self.max):
            worker = self._start()
            log.info(f"env workers: {len(self.workers)} (each has {self.threads} or more calls in flight)")
        call_id = next(self.next_id)
        self.pending[call_id] = (future, worker)
        self.ids[future] = call_id
        future.add_done_callback(self.ids.pop)
        worker.inflight += 1
        assert worker.channel is not None
        worker.channel.put(("call", call_id, ref, args, on_loop))
        return future

    def _ref(self, fn: Callable[..., Any]) -> Any:
        """How a call names ``fn`` to a worker: an environment's method by (environment, method); any other
        function pickled (it must be importable by name: a module-level function)."""
        owner = getattr(fn, "__self__", None)
        if inspect.ismethod(fn) and isinstance(owner, Environment) and owner.name in self.specs:
            return ("env", owner.name, fn.__name__)
        pickle.dumps(fn)  # refused here, at the call, rather than lost with the batch it would have gone in
        return fn

    def abandon(self, future: asyncio.Future) -> None:
        call_id = self.ids.get(future)
        future.cancel()
        if call_id is not None and (entry := self.pending.get(call_id)) is not None:
            channel = entry[1].channel
            assert channel is not None
            channel.put(("abandon", call_id))  # its worker answers "dropped" once the call is let go

    def _answer(self, worker: _Worker, batch: list) -> None:
        for message in batch:
            if message[0] == "cpu":
                worker.cpu_s = message[1]
                continue
            if message[0] == "ready":
                worker.up.set()
                continue
            if message[0] == "fatal":
                worker.fatal = message[1]
                continue
            entry = self.pending.pop(message[1], None)
            if entry is None:
                continue
            future, _ = entry
            worker.inflight -= 1
            if future.done():  # abandoned or cancelled: its result is not wanted
                continue
            if message[0] == "ok":
                future.set_result(message[2])
            elif message[0] == "error":
                future.set_exception(message[2])
            else:  # dropped by the worker unasked (a cancellation here would cancel the caller's task)
                future.set_exception(RuntimeError("the env worker dropped the call"))

    # -- the pool -------------------------------------------------------------------------------------
    async def started(self, future: asyncio.Future) -> None:
        """Wait until the worker holding ``future``'s call has built its environments (at most :data:`START_S`),
        or the call has ended (its worker died, or could not build them: the call's error says so)."""
        entry = self.pending.get(self.ids.get(future, -1))
        if entry is None or entry[1].up.is_set():
            return
        worker = entry[1]
        up = asyncio.ensure_future(worker.up.wait())
        try:
            done, _ = await asyncio.wait({up, future}, timeout=START_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            up.cancel()
        if not done:
            pid = worker.process.pid
            raise ScoringUnavailable(f"env worker {pid} did not build its environments in {START_S:.0f} s")

    def _bind(self) -> asyncio.AbstractEventLoop:
        """Attach the workers' channels to the running loop (the pool is built before the loop runs)."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            for worker in self.workers:
                self._connect(worker)
        return self.loop

    def _connect(self, worker: _Worker) -> None:
        assert self.loop is not None
        worker.channel = Channel(
            worker.conn, self.loop, lambda batch: self._answer(worker, batch), lambda: self._lost(worker)
        )

    def _start(self) -> _Worker:
        worker = _Worker(self.specs, self.data_dir, self.threads, self.max)
        self.workers.append(worker)
        self._connect(worker)
        return worker

    def _lost(self, worker: _Worker) -> None:
        """A worker's pipe closed: unless the pool is closing, it died. Its calls fail (the scorer sends them
        again), and a new worker takes its place if the pool is below ``min``."""
        if self.closing or worker not in self.workers:
            return
        self.workers.remove(worker)
        self.cpu_s += worker.cpu_s
        worker.process.join(1.0)  # its pipe closed: it has exited, or is about to
        code = worker.process.exitcode
        if worker.fatal is not None:
            error: Exception = ScoringUnavailable(f"an env worker could not build the environments:\n{worker.fatal}")
        else:
            self.restarts += 1
            error = WorkerLost(f"env worker {worker.process.pid} died (exit code {code})")
            log.warning(f"{error}; {sum(1 for e in self.pending.values() if e[1] is worker)} calls in it are lost")
        for call_id, (future, owner) in list(self.pending.items()):
            if owner is worker:
                del self.pending[call_id]
                if not future.done():
                    future.set_exception(error)
        while len(self.workers) < self.min:
            self._start()

    def take_stats(self) -> dict[str, float]:
        cpu = 0.0
        for worker in self.workers:
            cpu += worker.cpu_s - worker.cpu_taken
            worker.cpu_taken = worker.cpu_s
        cpu, self.cpu_s = cpu + self.cpu_s, 0.0
        restarts, self.restarts = self.restarts, 0
        return {
            "time/env_workers_cpu_s": cpu,
            "env_workers/workers": len(self.workers),
            "env_workers/restarts": restarts,
        }

    async def close(self) -> None:
        """Ask every worker to close its environments and exit; kill those still running after 10 s."""
        self.closing = True
        for worker in self.workers:
            if worker.channel is None:  # never used: no channel yet
                worker.conn.send([("close",)])
            else:
                worker.channel.put(("close",))
                worker.channel.close()
        await asyncio.to_thread(self._join, 10.0)

    def _join(self, timeout_s: float) -> None:
        for worker in self.workers:
            worker.process.join(timeout_s)
        self._kill()

    def _kill(self) -> None:
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(5)
            worker.conn.close()
        self.workers = []


def build_runner(oc: OrchestratorConfig, specs: dict[str, EnvSpec], data_dir: str | Path) -> Runner:
    """Where the environments' code runs (``orchestrator.env_workers``): worker processes, or threads of this one
    when ``max`` is 0."""
    ew = oc.env_workers
    if ew.max == 0:
        return Threads(oc.reward_workers)
    return EnvWorkers(specs, data_dir, min(ew.min, ew.max), ew.max, oc.reward_workers)
