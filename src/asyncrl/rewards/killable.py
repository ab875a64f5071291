"""Scoring in worker processes: a scorer that hangs is killed, not abandoned.

The orchestrator's :class:`~asyncrl.workers.scoring.Scorer` bounds a reward's time from a thread, but a
thread cannot be stopped: a symbolic check that never ends (sympy on ``9^9^9^9``) would keep a core and the
GIL forever. Rewards that can hang call :func:`call` instead: the function runs in a pebble process pool
whose worker is killed and replaced at the deadline. math-verify's own timeouts use ``signal.alarm``, which
works only in a main thread: they are switched off, and this deadline replaces them.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

from pebble import ProcessPool

_pool: Any = None
_lock = threading.Lock()
_parts = 1  # processes (env workers) that each hold a pool like this one: they share the CPUs


def _warm() -> None:
    """Each worker imports the heavy scorers before its first task (so imports do not eat the deadline):
    importing them is this function's purpose, so the imports stay in it."""

    import math_verify  # noqa: F401  # lazy: warms the worker before its first task
    import reasoning_gym  # noqa: F401  # lazy: warms the worker before its first task

    # math-verify warns on every call that its own timeouts are off: they are, on purpose (see above)
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def pool() -> Any:
    global _pool
    with _lock:
        if _pool is None:
            # forkserver: forking the orchestrator (threads, an event loop, sockets) is unsafe
            _pool = ProcessPool(
                max_workers=max(1, (os.cpu_count() or 1) // _parts),
                initializer=_warm,
                context=multiprocessing.get_context("forkserver"),
            )
            atexit.register(shutdown)
        return _pool


def share(parts: int) -> None:
    """This process is one of ``parts`` that score with such a pool (env workers): its pool, started on first
    use, takes a ``1/parts`` share of the CPUs."""
    global _parts
    _parts = max(1, parts)


def call(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """``fn(*args)`` in a worker process; raises ``TimeoutError`` past ``timeout_s`` (the worker is
    killed)."""
    return pool().schedule(fn, args=args, timeout=timeout_s).result()


def shutdown() -> None:
    global _pool
    with _lock:
        if _pool is not None:
            _pool.stop()
            _pool.join()
            _pool = None
