"""How many requests start their work on the event loop per turn of it, so that ``/health`` is answered in a
burst.

asyncio runs, in one turn of its loop, every callback that was ready when the turn began. When a burst of
requests arrives together, each one's first step through the app (middleware, body, validation, the route up
to its first ``await``) becomes ready in the same turn: 1,024 of them take seconds of CPU on a shared 2-core
machine, and a ``/health`` that arrives meanwhile waits for all of them, then for its own few turns behind
the next stages of the burst. :class:`Admission` queues requests at the app's door and lets ``per_turn`` of
them in per turn of the loop, so a turn holds a bounded share of the burst and ``/health``, which skips the
queue, waits for one share at most. Nothing is refused: every request gets in, in the order it came
(``python benchmarks/sidecar_load.py --help`` measures ``/health`` under a burst).
"""

from __future__ import annotations

import asyncio
from collections import deque

# requests let into the app per turn of the event loop: a turn then holds about this many milliseconds of
# their first steps (about 1 ms each on a busy 2-core Xeon), while a burst of 1,024 gets in within 64 turns
PER_TURN = 16


class Admission:
    """ASGI middleware: HTTP requests other than ``exempt`` paths enter ``app`` at most ``per_turn`` per loop
    turn, first come first in."""

    def __init__(self, app, per_turn: int = PER_TURN, exempt: tuple[str, ...] = ("/health",)):
        assert per_turn >= 1, per_turn
        self.app, self.per_turn, self.exempt = app, per_turn, exempt
        self.waiting: deque[asyncio.Future] = deque()
        self.pumping = False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.exempt:
            await self._wait_turn()
        return await self.app(scope, receive, send)

    async def _wait_turn(self) -> None:
        loop = asyncio.get_running_loop()
        if not self.waiting and not self.pumping:
            # the first of a quiet spell goes straight in; the pump starts for any that follow in this turn
            self.pumping = True
            loop.call_soon(self._pump, loop)
            return
        turn = loop.create_future()
        self.waiting.append(turn)
        await turn

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let the next ``per_turn`` waiting requests in; again next turn while any wait."""
        let_in = 0
        while self.waiting and let_in < self.per_turn:
            turn = self.waiting.popleft()
            if not turn.done():  # a request whose client went away was cancelled while it waited
                turn.set_result(None)
                let_in += 1
        if self.waiting:
            loop.call_soon(self._pump, loop)
        else:
            self.pumping = False
