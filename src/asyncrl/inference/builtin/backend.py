"""The built-in backend's answers to the admin routes (:class:`asyncrl.inference.admin_routes.Backend`), and
the watch that stops the server when its engine dies."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from fastapi import Request

from asyncrl.inference.admin import checked_update
from asyncrl.inference.builtin.batcher import Batcher
from asyncrl.inference.builtin.engine_process import EngineClient, EngineDied
from asyncrl.inference.errors import BadRequest
from asyncrl.inference.protocol import UpdateWeightsRequest
from asyncrl.transport.base import Transport

log = logging.getLogger("asyncrl.inference")


class BuiltinBackend:
    """Weights load between two decode steps of the running requests; pausing stops admissions and waits for
    the admitted requests. ``roots``: where ``/update_weights`` may load from (``None`` = anywhere)."""

    def __init__(self, engine: EngineClient, batcher: Batcher, roots: list[Path] | None):
        self.engine, self.batcher, self.roots = engine, batcher, roots
        self.updating = asyncio.Lock()  # one update at a time: versions only move forward

    @property
    def version(self) -> int:
        return self.engine.version

    async def pause(self, request: Request) -> None:
        await self.batcher.pause()

    async def resume(self, request: Request) -> None:
        self.batcher.running.set()

    async def update_weights(self, body: UpdateWeightsRequest, request: Request) -> dict[str, Any]:
        async with self.updating:
            path = checked_update(body.path, body.version, self.engine.version, self.roots, Transport)
            start = time.perf_counter()
            try:
                # between two decode steps: running completions go on with the new weights (in-flight update)
                await asyncio.get_running_loop().run_in_executor(
                    None, self.engine.load_weights, path, body.version
                )
            except EngineDied:
                raise
            # wrong, unreadable or damaged files: the caller's
            except (OSError, ValueError, RuntimeError) as e:
                raise BadRequest(f"cannot load weights from {path}: {e}", param="path") from None
            return {"version": self.engine.version, "seconds": time.perf_counter() - start}


async def exit_when_dead(engine: EngineClient, every_s: float = 0.5) -> None:
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
        log.error(
            f"the engine process died{how}; its traceback, if any, is above in "
            "this log. Stopping the server."
        )
    sys.stderr.flush()
    os._exit(1)
