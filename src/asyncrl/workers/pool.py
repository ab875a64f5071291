"""Environments in worker processes: :class:`EnvWorkers`, the :class:`~asyncrl.workers.threads.Runner` that
runs rewards and episodes in a pool of processes (:mod:`asyncrl.workers.process`), so a reward that blocks or
crashes stalls or kills its worker, never the orchestrator's event loop.

What crosses: a call of an environment's method, named (environment, method) since each worker builds its own
copy of the environments from the run's config, with its arguments (an example and a completion; an episode's
example, sidecar URL and sampling settings); and its result (a number; a
:class:`~asyncrl.rollouts.trajectory.Rollout`). Generation stays in the orchestrator's client; a verifiers
episode, whose own client calls the sidecars, runs whole in a worker, on the sidecar the orchestrator picked.

The pool starts ``min`` workers. A call goes to the worker that is up and has the fewest calls in flight; a
reward needs one of its ``threads`` reward threads free, an episode (which runs on the worker's event loop)
does not. A call that finds no such worker waits in the pool's queue, in order, and is sent when one has
room, so a worker that starts later can take it. The pool grows to demand: once it has been saturated (every
worker with ``threads`` calls in flight, or calls queued) for as long as a worker takes to start (measured on
this pool's workers), another worker starts, one at a time, up to ``max``. A burst of quick calls, which the
running workers clear sooner than a new one could start, starts none; a load that keeps every worker busy
grows the pool. A call's deadline starts when a worker takes it (:meth:`EnvWorkers.started`): neither a
worker's start-up (a fork, the environments) nor the queue counts against it. A worker
that dies is replaced; the calls it held fail with :class:`~asyncrl.workers.threads.WorkerLost`, which the
scorer sends again (bounded) and then counts.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import itertools
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.config.orchestrator import EnvSpec, OrchestratorConfig
from asyncrl.envs.base import Environment
from asyncrl.envs.registry import BUILTIN
from asyncrl.utils.channel import Channel
from asyncrl.utils.errors import ScoringUnavailable
from asyncrl.workers.process import serve
from asyncrl.workers.threads import Runner, Threads, WorkerLost

log = logging.getLogger("asyncrl.envs")

# forkserver: each worker is a fork of one server process per orchestrator, a fresh interpreter that imported
# the environments' built-in modules once (:func:`_preload`), so a worker that the pool adds starts in a
# fraction of a second where a fresh interpreter spends seconds importing verifiers
# (`python -c "import asyncrl.envs.vf_env"`: 4.6 s of CPU). Forking the orchestrator itself, with its
# threads, event loop and sockets, would be unsafe. A worker takes this process's sys.path (environments on
# PYTHONPATH or added by a test import there too) and environment at its start, as a fresh one would.
_CONTEXT = multiprocessing.get_context("forkserver")
# a worker builds every environment (and the first one waits for the server's imports)
START_S = 300.0


def _preload(specs: dict[str, EnvSpec]) -> None:
    """The server imports the worker's module and the built-in modules of ``specs``' environments; only
    those: a user's module runs its import in each worker, where an error in it is reported as the worker's.
    Set before the server starts, at the pool's first worker (a process's later pools share that server)."""
    modules = ["asyncrl.workers.process"]
    modules += [BUILTIN[s.type].partition(":")[0] for s in specs.values() if s.type in BUILTIN]
    _CONTEXT.set_forkserver_preload(list(dict.fromkeys(modules)))
    atexit.unregister(_stop_server)
    atexit.register(_stop_server)


def _stop_server() -> None:
    """At exit the server goes with this process, waited for, rather than ending just after it as an orphan
    (it ends when this process's end of its pipe closes). ``_stop`` is private to multiprocessing: where a
    Python lacks it, the server still ends by itself."""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


class _Worker:
    def __init__(self, specs: dict[str, EnvSpec], data_dir: str, threads: int, parts: int):
        self.conn, child = _CONTEXT.Pipe()
        # not daemonic: a worker may start processes of its own (the math rewards' pool, the sandbox)
        args = (child, specs, data_dir, threads, parts, dict(os.environ))
        self.process = _CONTEXT.Process(target=serve, args=args, name="env-worker")
        self.process.start()
        child.close()
        self.born = time.monotonic()
        self.inflight = 0  # calls it holds
        self.threads_busy = 0  # of which rewards (an episode runs on its loop, not in a thread)
        self.up = asyncio.Event()  # set once its environments are built: calls sent to it start at once
        self.cpu_s = self.cpu_taken = 0.0
        self.fatal: str | None = None
        self.channel: Channel | None = None


class EnvWorkers:
    """Implements :class:`~asyncrl.workers.threads.Runner` with ``min_workers`` to ``max_workers`` processes
    of ``threads`` reward threads each, holding the environments of ``specs`` (built from ``data_dir``)."""

    def __init__(
        self,
        specs: dict[str, EnvSpec],
        data_dir: str | Path,
        min_workers: int,
        max_workers: int,
        threads: int,
    ):
        assert 0 <= min_workers <= max_workers and max_workers >= 1 and threads >= 1
        self.specs, self.data_dir, self.threads = dict(specs), str(data_dir), threads
        self.min, self.max = min_workers, max_workers
        self.capacity = threads * max_workers
        self.workers: list[_Worker] = []
        # calls a worker holds, on its loop?
        self.pending: dict[int, tuple[asyncio.Future, _Worker, bool]] = {}
        self.queued: OrderedDict[int, tuple[asyncio.Future, tuple]] = OrderedDict()  # calls waiting for one
        self.sent = asyncio.Event()  # set, then cleared, each time queued calls are sent to workers
        self.start_s = 1.0  # how long a worker takes to start: measured on each one that comes up
        self.saturated_since: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.ids: dict[asyncio.Future, int] = {}
        self.next_id = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.restarts = 0
        self.cpu_s = 0.0  # of the workers that are gone
        self.closing = False
        # started now: they import and build the environments while the run starts
        _preload(self.specs)
        for _ in range(min_workers):
            self.workers.append(_Worker(self.specs, self.data_dir, threads, max_workers))
        atexit.register(self._kill)

    # -- calls ----------------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], args: tuple, on_loop: bool) -> asyncio.Future:
        loop = self._bind()
        future = loop.create_future()
        call_id = next(self.next_id)
        self.ids[future] = call_id
        future.add_done_callback(self.ids.pop)
        self.queued[call_id] = (future, ("call", call_id, self._ref(fn), args, on_loop))
        self._send()
        return future

    def _send(self) -> None:
        """Send queued calls, oldest first, to the workers that are up and have room for them; then note
        whether the pool is saturated and see whether it should grow (:meth:`_grow`)."""
        up = [w for w in self.workers if w.up.is_set()]
        for call_id, (future, message) in list(self.queued.items()):
            on_loop = message[4]
            worker = min(
                (w for w in up if on_loop or w.threads_busy < self.threads),
                key=lambda w: w.inflight,
                default=None,
            )
            if worker is None:
                if on_loop:
                    break  # no worker is up
                continue  # every reward thread is busy; an episode behind it may still go
            del self.queued[call_id]
            if future.done():  # its caller gave up while it waited
                continue
            self.pending[call_id] = (future, worker, on_loop)
            worker.inflight += 1
            worker.threads_busy += not on_loop
            assert worker.channel is not None
            worker.channel.put(message)
            self.sent.set()
        self.sent.clear()
        # counted only while a worker is up: calls that wait for the first workers to start are not demand
        saturated = bool(up) and (bool(self.queued) or all(w.inflight >= self.threads for w in up))
        if not saturated:
            self.saturated_since = None
        elif self.saturated_since is None:
            self.saturated_since = time.monotonic()
        self._grow()

    def _grow(self) -> None:
        """Start another worker once the pool has been saturated for as long as a worker takes to start (one
        starting at a time, up to ``max``); with calls queued and no worker at all, at once. Otherwise look
        again when it will have been."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.workers and self.queued:
            self._start()
            return
        since = self.saturated_since
        if since is None or len(self.workers) >= self.max or any(not w.up.is_set() for w in self.workers):
            return
        waited = time.monotonic() - since
        if waited < self.start_s:
            assert self.loop is not None
            self.timer = self.loop.call_later(self.start_s - waited, self._grow)
            return
        self._start()
        log.info(f"env workers: {len(self.workers)} (every one busy for {waited:.1f} s)")

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
        if call_id is not None and self.queued.pop(call_id, None) is not None:  # never sent
            return
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
                self.start_s = time.monotonic() - worker.born
                self._send()
                continue
            if message[0] == "fatal":
                worker.fatal = message[1]
                continue
            entry = self.pending.pop(message[1], None)
            if entry is None:
                continue
            future, _, on_loop = entry
            worker.inflight -= 1
            worker.threads_busy -= not on_loop
            self._send()
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
        """Wait until a worker has taken ``future``'s call, or the call has ended (a worker could not build
        the environments: the call's error says so). Raises :class:`ScoringUnavailable` when no worker has
        come up in :data:`START_S` (a queue behind busy workers that are up is waited out: their calls have
        deadlines)."""
        call_id = self.ids.get(future, -1)
        since = time.monotonic()
        while call_id in self.queued and not future.done():
            if any(w.up.is_set() for w in self.workers):
                since = time.monotonic()
            elif time.monotonic() - since > START_S:
                raise ScoringUnavailable(f"no env worker built its environments in {START_S:.0f} s")
            sent = asyncio.ensure_future(self.sent.wait())
            try:
                await asyncio.wait({sent, future}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sent.cancel()

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
            error: Exception = ScoringUnavailable(
                f"an env worker could not build the environments:\n{worker.fatal}"
            )
        else:
            self.restarts += 1
            error = WorkerLost(f"env worker {worker.process.pid} died (exit code {code})")
            log.warning(
                f"{error}; {sum(1 for e in self.pending.values() if e[1] is worker)} calls in it are lost"
            )
        for call_id, (future, owner, _) in list(self.pending.items()):
            if owner is worker:
                del self.pending[call_id]
                if not future.done():
                    future.set_exception(error)
        if worker.fatal is not None:  # every worker would fail the same way: so do the calls waiting for one
            for future, _ in self.queued.values():
                if not future.done():
                    future.set_exception(error)
            self.queued.clear()
        while len(self.workers) < self.min:
            self._start()
        self._grow()

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
            "env_workers/queued": len(self.queued),
        }

    async def close(self) -> None:
        """Ask every worker to close its environments and exit; kill those still running after 10 s."""
        self.closing = True
        if self.timer is not None:
            self.timer.cancel()
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
    """Where the environments' code runs (``orchestrator.env_workers``): worker processes, or threads of this
    one when ``max`` is 0."""
    ew = oc.env_workers
    if ew.max == 0:
        return Threads(oc.reward_workers)
    return EnvWorkers(specs, data_dir, min(ew.min, ew.max), ew.max, oc.reward_workers)
