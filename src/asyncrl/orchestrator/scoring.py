"""Scoring untrusted model output: a reward that raises, hangs or returns garbage scores 0 and is counted.

Each call runs in a daemon thread (a hung reward cannot be killed, but it must neither block the step
nor keep the process alive at exit, as a ThreadPoolExecutor's workers would).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Scorer:
    def __init__(self, workers: int, timeout_s: float):
        self.limit = asyncio.Semaphore(workers)
        self.timeout_s = timeout_s
        self.errors = 0
        self.timeouts = 0
        self.episode_errors = 0  # multi-turn episodes that failed outside their reward (the env's code, a turn)

    async def score(self, fn: Callable[[dict, str], float], example: dict[str, Any], completion: str) -> float:
        async with self.limit:
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def work() -> None:
                try:
                    result: Any = fn(example, completion)
                    exc = None
                except BaseException as e:  # reward code is untrusted: any failure scores 0
                    result, exc = None, e
                loop.call_soon_threadsafe(_settle, future, result, exc)

            threading.Thread(target=work, daemon=True, name="reward").start()
            done, _ = await asyncio.wait({future}, timeout=self.timeout_s)
            if not done:
                future.cancel()  # the thread's late result is then dropped by _settle
                self.timeouts += 1
                log.warning(f"reward timed out after {self.timeout_s}s; scoring 0")
                return 0.0
            try:
                value = future.result()
            except TimeoutError as e:  # the reward's own deadline (a scoring process killed: asyncrl.rewards)
                self.timeouts += 1
                log.warning(f"reward timed out ({e or 'its own deadline'}); scoring 0")
                return 0.0
            except Exception as e:
                self.errors += 1
                log.warning(f"reward raised {type(e).__name__}: {e}; scoring 0")
                return 0.0
        try:
            value = float(value)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            self.errors += 1
            log.warning("reward returned a non-finite or non-numeric value; scoring 0")
            return 0.0
        return value

    def take_counts(self) -> dict[str, int]:
        counts = {"rollout/reward_errors": self.errors, "rollout/reward_timeouts": self.timeouts}
        if self.episode_errors:
            counts["rollout/episode_errors"] = self.episode_errors
        self.errors = self.timeouts = self.episode_errors = 0
        return counts


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # timed out already
        return
    if exc is not None:
        future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
    else:
        future.set_result(result)
