"""How busy the orchestrator's event loop is: its lag and the process's CPU time, per batch.

Every rollout, reward and relay of the orchestrator shares one asyncio loop. A loop that is late to wake a
task delays every request it should have sent and every answer it should have read, without any error:
``time/loop_lag_p99_ms`` (and ``_max_ms``) say how late a timer scheduled every 10 ms actually ran,
``time/orchestrator_cpu_s`` how much CPU the process used since the last batch. Both are timing metrics
(``time/``): they differ between any two runs and are not part of what a replay compares.
"""

from __future__ import annotations

import asyncio
import time


def lag_stats(lags_s: list[float]) -> dict[str, float]:
    """The p99 and max of ``lags_s`` (seconds) in milliseconds (pure; nearest-rank p99, 0 when empty)."""
    if not lags_s:
        return {"time/loop_lag_p99_ms": 0.0, "time/loop_lag_max_ms": 0.0}
    ordered = sorted(lags_s)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"time/loop_lag_p99_ms": 1e3 * p99, "time/loop_lag_max_ms": 1e3 * ordered[-1]}


class LoopMonitor:
    """A task that sleeps ``every_s`` and records how much later than asked it woke up."""

    def __init__(self, every_s: float = 0.01):
        self.every_s = every_s
        self.lags: list[float] = []
        self.cpu_mark = time.process_time()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.every_s)
            self.lags.append(max(0.0, time.perf_counter() - start - self.every_s))

    def take(self) -> dict[str, float]:
        """The lag since the last call, and the CPU seconds of this process since then."""
        now = time.process_time()
        out = {**lag_stats(self.lags), "time/orchestrator_cpu_s": now - self.cpu_mark}
        self.lags, self.cpu_mark = [], now
        return out

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
