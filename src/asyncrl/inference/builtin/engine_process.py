"""Driving the CPU engine: its step loop, in a process of its own (``asyncrl serve``) or in a thread.

:func:`serve_engine` is the loop: between two decode steps it takes every message waiting on its pipe
(``add`` requests, ``call`` a method such as ``load_weights``), then runs one :meth:`HFEngine.step` and sends
back the jobs that finished. So requests join the running batch, and weights change, between decode steps,
never during one. When nothing runs it blocks on the pipe.

:class:`EngineClient` is the other end: :meth:`~EngineClient.submit` returns a future per job,
:meth:`~EngineClient.call` blocks until the loop has run the method; a reader thread hands each answer to
its future. Two ways to run the loop:

- :class:`EngineProcess`: a child process holding the model (see :func:`start_method`). Decoding
  runs Python between torch ops and holds the GIL for most of each step; in the server's process it competes
  with the event loop, and under a burst of requests ``/health`` waits seconds (``python
  benchmarks/sidecar_load.py --engines process inprocess`` compares the two).
  The child inherits the environment, so the numerics mode applied by ``asyncrl.cli`` holds in it too; it
  exits when the pipe closes (its parent died); if it dies, every call fails with :class:`EngineDied` and
  the server stops (:func:`asyncrl.inference.builtin.backend.exit_when_dead`).
- :class:`EngineThread`: the loop in a thread of this process, over an :class:`HFEngine` built by the
  caller (tests, embedding).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import pickle
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine import Completion, GenRequest, HFEngine
from asyncrl.inference.builtin.engine_limits import EngineLimits
from asyncrl.models.hf import load_tokenizer
from asyncrl.numerics import configure_torch
from asyncrl.utils.process import setup_logging

log = logging.getLogger("asyncrl.inference")


class EngineDied(RuntimeError):
    """The engine (its process or thread) is gone; nothing more can be generated."""


def serve_engine(engine: HFEngine, conn) -> None:
    """The engine's loop over ``conn`` until it closes. Messages: ``("add", key, requests)`` answered
    ``("done", key, completions)`` when the job finishes; ``("call", key, method, args)`` answered at once;
    a failure is ``("error", key, exception)``."""
    while True:
        try:
            # while cohorts run, take only what is already waiting; when idle, wait for the next message
            while conn.poll(0 if engine.busy else None):
                _handle(engine, conn, conn.recv())
        except (EOFError, OSError):  # the client is gone
            return
        if not engine.busy:
            continue
        try:
            finished = engine.step()
        except Exception as e:  # a bug or out of memory: fail what was running, keep serving
            log.exception("a decode step failed; failing the running requests")
            for job in list(engine.jobs):
                engine.cancel(job)
                _send(conn, ("error", job, _portable(e)))
            continue
        for job, out in finished:
            _send(conn, ("done", job, out))


def _handle(engine: HFEngine, conn, message: tuple) -> None:
    kind, key, *args = message
    try:
        if kind == "add":
            engine.add(args[0], job_id=key)  # answered by the step that finishes it
            return
        method, method_args = args
        reply: tuple = ("done", key, getattr(engine, method)(*method_args))
    # the caller's problem (bad weights, a bad request) or a bug: the client answers it
    except Exception as e:
        reply = ("error", key, _portable(e))
    _send(conn, reply)


def _send(conn, message: tuple) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, OSError):  # the client died while we generated; the next poll sees EOF
        pass


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a RuntimeError with its text (exceptions with custom __init__s
    may not)."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _serve_child(
    conn,
    model_cfg: ModelConfig,
    cfg: InferenceConfig,
    seed: int,
    device: str | None,
    numerics: str | None,
    parent_end=None,
) -> None:
    """The child process: build the engine, announce its limits, then run the loop until the pipe closes.
    ``parent_end``: the server's end of the pipe, which a forked child holds a copy of and closes, so that
    the pipe closes when the server dies."""
    if parent_end is not None:
        parent_end.close()
    setup_logging("inference.engine")
    try:
        configure_torch(numerics, cfg.num_threads)
        engine = HFEngine(model_cfg, cfg, seed, device=device)
    except BaseException as e:
        conn.send(("error", None, _portable(e)))
        raise
    conn.send(("ready", None, {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size}))
    serve_engine(engine, conn)


def start_method() -> str:
    """How the engine's process starts: ``fork`` while that is safe (this process runs one thread and has not
    initialised CUDA, which a forked child cannot initialise again), so that the child starts with torch and
    the model code already imported, about 3.5 s of CPU less per sidecar start on 2 cores
    (``python -X importtime -c "import asyncrl.inference.builtin.engine"``); ``spawn`` otherwise (an
    embedding with threads running: fork copies one thread and any lock another one held)."""
    return "fork" if threading.active_count() == 1 and not torch.cuda.is_initialized() else "spawn"


class EngineClient(EngineLimits):
    """The server's handle on an engine loop at the other end of ``conn``."""

    def __init__(self, conn, tokenizer, model_name: str, max_model_len: int, vocab_size: int):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.version = 0
        self._conn = conn
        self._keys = itertools.count()
        self._futures: dict[int, Future] = {}
        self._send_lock = threading.Lock()
        self._dead: EngineDied | None = None
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def _why_dead(self) -> EngineDied:
        return EngineDied("the engine stopped")

    def _read(self) -> None:
        while True:
            try:
                kind, key, value = self._conn.recv()
            except (EOFError, OSError):
                break
            future = self._futures.pop(key, None)
            if future is None:
                continue
            if kind == "error":
                future.set_exception(value)
            else:
                future.set_result(value)
        self._dead = self._why_dead()
        for future in list(self._futures.values()):
            future.set_exception(self._dead)
        self._futures.clear()

    def _post(self, *message: Any) -> Future:
        future: Future = Future()
        with self._send_lock:
            if self._dead is not None:
                future.set_exception(self._dead)
                return future
            key = next(self._keys)
            self._futures[key] = future
            try:
                self._conn.send((message[0], key, *message[1:]))
            except (BrokenPipeError, OSError):
                pass  # the reader sees the pipe close and fails the future
        return future

    def submit(self, requests: list[GenRequest]) -> Future:
        """Add ``requests`` to the running batch; the future's result: completions per request, per
        choice."""
        return self._post("add", requests)

    def call(self, method: str, *args: Any) -> Any:
        """Run ``method`` of the engine between two decode steps; blocks until it has (raises what it
        raised)."""
        return self._post("call", method, args).result()

    def alive(self) -> bool:
        return self._dead is None

    def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        return self.submit(requests).result()

    def load_weights(self, path: str | Path, version: int) -> None:
        """All or nothing, as :meth:`HFEngine.load_weights`, between two decode steps of the running
        requests; the version changes only once the engine says so."""
        self.call("load_weights", path, version)
        self.version = version

    def close(self) -> None:
        self._conn.close()


class EngineProcess(EngineClient):
    """An :class:`HFEngine` in a child process."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: InferenceConfig,
        seed: int,
        numerics: str | None,
        device: str | None = None,
        start_timeout_s: float = 600,
    ):
        # Process.join is not thread-safe, and both the reader thread (to name the exit code) and close()
        # join: unserialised, one reaps the child and the other's is_alive() answers True for good
        self._reaping = threading.Lock()
        method = start_method()
        ctx = (
            multiprocessing.get_context("fork") if method == "fork" else multiprocessing.get_context("spawn")
        )
        conn, child = ctx.Pipe()
        # spawn passes the child only what its arguments name
        parent_end = conn if method == "fork" else None
        self.process = ctx.Process(
            target=_serve_child,
            args=(child, model_cfg, cfg, seed, device, numerics, parent_end),
            name="engine",
            daemon=True,
        )
        self.process.start()
        child.close()
        if not conn.poll(start_timeout_s):
            self._stop(conn)
            raise EngineDied(f"the engine process did not start within {start_timeout_s:.0f} s")
        try:
            kind, _, info = conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineDied(
                f"the engine process died while starting (exit code {self.process.exitcode})"
            ) from None
        if kind == "error":
            self._stop(conn)
            raise info
        super().__init__(
            conn, load_tokenizer(model_cfg), model_cfg.name, info["max_model_len"], info["vocab_size"]
        )

    def _join(self, timeout_s: float | None) -> None:
        with self._reaping:
            self.process.join(timeout_s)

    def _why_dead(self) -> EngineDied:
        self._join(5)
        return EngineDied(
            f"the engine process died (exit code {self.process.exitcode}); its traceback is in this log"
        )

    def alive(self) -> bool:
        return self.process.is_alive() and super().alive()

    def _stop(self, conn) -> None:
        conn.close()
        self._join(10)
        if self.process.is_alive():
            self.process.kill()
            self._join(None)

    def close(self) -> None:
        self._stop(self._conn)


class EngineThread(EngineClient):
    """The loop over an :class:`HFEngine` of this process, in a daemon thread."""

    def __init__(self, engine: HFEngine):
        ours, theirs = multiprocessing.Pipe()  # a pipe between threads: the same protocol as the process
        self.engine = engine
        self.thread = threading.Thread(
            target=serve_engine, args=(engine, theirs), name="engine", daemon=True
        )
        self.thread.start()
        self._theirs = theirs
        super().__init__(ours, engine.tokenizer, engine.model_name, engine.max_model_len, engine.vocab_size)
        self.version = engine.version

    def alive(self) -> bool:
        return self.thread.is_alive() and super().alive()

    def close(self) -> None:
        super().close()
        self.thread.join(10)
        self._theirs.close()
