"""Batched messages between two processes over a ``multiprocessing`` pipe, off the event loop.

:meth:`Channel.put` queues a message; every message put in one turn of the event loop goes as one pickle,
which a sender thread writes, so the loop never waits on a full pipe (a peer still starting reads nothing for
a second) and thousands of small messages cost one write. A reader thread hands each batch received to
``on_batch`` on the loop, and calls ``on_closed`` there once the other end is gone (it exited, or died).
Closing a pipe that a thread of this process is reading does not end it for the peer (the blocked read holds
it open): a peer is asked to exit by a message, and the pipe ends when it does.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)


class Channel:
    """``stamp``: a message appended to every batch sent (what the sender reports with each, e.g. its CPU
    time)."""

    def __init__(
        self,
        conn: Connection,
        loop: asyncio.AbstractEventLoop,
        on_batch: Callable[[list], None],
        on_closed: Callable[[], None],
        stamp: Callable[[], Any] | None = None,
    ):
        self.conn, self.loop, self.on_batch, self.on_closed, self.stamp = (
            conn,
            loop,
            on_batch,
            on_closed,
            stamp,
        )
        self.outbox: list = []
        self.sending: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._send, daemon=True, name="channel-send").start()
        threading.Thread(target=self._read, daemon=True, name="channel-read").start()

    def put(self, message: Any) -> None:
        self.outbox.append(message)
        if len(self.outbox) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        batch, self.outbox = self.outbox, []
        if self.stamp is not None:
            batch.append(self.stamp())
        self.sending.put(batch)

    def close(self) -> None:
        """Send what is queued, then stop sending."""
        if self.outbox:
            self._flush()
        self.sending.put(None)

    def _send(self) -> None:
        while (batch := self.sending.get()) is not None:
            try:
                self.conn.send(batch)
            except OSError:  # the peer is gone: the reader reports it
                return
            except Exception:  # a message that cannot be pickled: the calls in it time out, counted
                log.exception(f"a batch of {len(batch)} messages could not be sent")

    def _read(self) -> None:
        while True:
            try:
                batch = self.conn.recv()
            except (EOFError, OSError):
                self._call(self.on_closed)
                return
            self._call(self.on_batch, batch)

    def _call(self, fn: Callable, *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the run is over
            pass
