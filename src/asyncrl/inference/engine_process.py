"""The CPU engine in a process of its own, behind the same interface as :class:`HFEngine`.

Why: decoding runs Python between torch ops and holds the GIL for most of each step. In the server's
process it competed with the event loop, so under a burst of 1,024 requests ``/health`` waited seconds
(issue 11). Here the server keeps the tokenizer, the request checks and the HTTP work; the child process
holds the model and does ``generate`` and ``load_weights``, one call at a time over a pipe.

The child is started with ``spawn`` (torch and fork do not mix) and inherits the environment, so the
numerics mode applied by ``asyncrl.cli`` holds in it too. It exits when the pipe closes (its parent died);
if it dies, every call fails with :class:`EngineDied` and the server stops (see ``server.build_app``).
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
from pathlib import Path
from typing import Any

from asyncrl.config.sections import InferenceConfig, ModelConfig
from asyncrl.inference.engine import Completion, EngineLimits, GenRequest

log = logging.getLogger("asyncrl.inference")


class EngineDied(RuntimeError):
    """The engine process is gone; nothing more can be generated."""


def _serve(
    conn, model_cfg: ModelConfig, cfg: InferenceConfig, seed: int, device: str | None, numerics: str | None
) -> None:
    """The child's loop: build the engine, announce its limits, then answer calls until the pipe closes."""
    from asyncrl.numerics import configure_torch
    from asyncrl.utils.process import setup_logging

    setup_logging("inference.engine")
    try:
        configure_torch(numerics, cfg.num_threads)
        from asyncrl.inference.engine import HFEngine

        engine = HFEngine(model_cfg, cfg, seed, device=device)
    except BaseException as e:
        conn.send(("error", _portable(e)))
        raise
    conn.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size}))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        try:
            reply: tuple[str, Any] = ("ok", getattr(engine, method)(*args))
        except Exception as e:  # the caller's problem (bad weights) or a bug: either way the server answers it
            reply = ("error", _portable(e))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):  # the server died while we generated
            return


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a RuntimeError with its text (exceptions with custom __init__s
    may not)."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


class EngineProcess(EngineLimits):
    """A handle on an :class:`HFEngine` in a child process; ``generate`` and ``load_weights`` block the calling
    thread (the server's executor) on the pipe, which leaves the GIL to the event loop."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: InferenceConfig,
        seed: int,
        numerics: str | None,
        device: str | None = None,
        start_timeout_s: float = 600,
    ):
        from asyncrl.models import load_tokenizer

        self.tokenizer = load_tokenizer(model_cfg)
        self.model_name = model_cfg.name
        self.version = 0
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, model_cfg, cfg, seed, device, numerics), name="engine", daemon=True
        )
        self.process.start()
        child.close()
        self._lock = threading.Lock()  # one call on the pipe at a time
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise EngineDied(f"the engine process did not start within {start_timeout_s:.0f} s")
        kind, info = self._receive()
        if kind == "error":
            self.close()
            raise info
        self.max_model_len, self.vocab_size = info["max_model_len"], info["vocab_size"]

    def _receive(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineDied(
                f"the engine process died (exit code {self.process.exitcode}); its traceback is in this log"
            ) from None

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            try:
                self._conn.send((method, args))
            except (BrokenPipeError, OSError):
                pass  # _receive reports the death
            kind, value = self._receive()
        if kind == "error":
            raise value
        return value

    def alive(self) -> bool:
        return self.process.is_alive()

    def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        return self._call("generate", requests)

    def load_weights(self, path: str | Path, version: int) -> None:
        """All or nothing, as :meth:`HFEngine.load_weights`; the version changes only once the child says so."""
        self._call("load_weights", path, version)
        self.version = version

    def close(self) -> None:
        self._conn.close()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
