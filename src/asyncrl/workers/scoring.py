"""Running untrusted environment code: a reward that raises, hangs or returns garbage scores 0 and is
counted.

The :class:`Scorer` is the guard; where the code runs is its runner's business
(:mod:`asyncrl.workers.threads`: threads of this process, or :class:`asyncrl.workers.pool.EnvWorkers`, worker
processes), chosen once at start. A call whose worker process died is sent again (``lost_retries`` times),
then scores 0, counted.

A failure of what a reward runs on (:class:`asyncrl.utils.errors.ScoringUnavailable`, e.g. a sandbox that
cannot start) is not the completion's: it is retried, then stops the run with the cause, instead of scoring
0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from asyncrl.utils.errors import ScoringUnavailable
from asyncrl.workers.threads import Runner, WorkerLost

log = logging.getLogger(__name__)

# a reward whose infrastructure failed is tried this many more times, after 0.5 s, then 1 s: long enough for
# a sandbox that failed to start under a momentary shortage (processes, memory) to start on the next try
RETRIES = 2
RETRY_WAIT_S = 0.5


class Scorer:
    """``runner``: where calls run; ``timeout_s``: a reward's deadline; ``lost_retries``: further attempts of
    a call whose worker process died."""

    def __init__(self, runner: Runner, timeout_s: float, lost_retries: int = 1):
        self.runner = runner
        self.limit = asyncio.Semaphore(runner.capacity)
        self.timeout_s = timeout_s
        self.lost_retries = lost_retries
        self.errors = 0
        self.timeouts = 0
        # multi-turn episodes that failed outside their reward (the env's code, a turn)
        self.episode_errors = 0
        # what environments count themselves (an agent's errors...), by name
        self.causes: Counter[str] = Counter()
        self.seconds = 0.0  # the rewards' wall time, summed over calls (they run beside generation)

    async def score(
        self, fn: Callable[[dict, str], float], example: dict[str, Any], completion: str
    ) -> float:
        """``fn``'s reward, 0 (counted) when it raises, hangs or returns no number. When what it runs on
        fails (:class:`ScoringUnavailable`: a sandbox that cannot start), it is tried again up to
        :data:`RETRIES` times, then the error stops the run: scoring such samples 0 would train on zeros."""
        return (await self.score_with_info(fn, example, completion))[0]

    async def score_with_info(
        self, fn: Callable[[dict, str], Any], example: dict[str, Any], completion: str
    ) -> tuple[float, dict[str, float]]:
        """:meth:`score` of a reward that may also say how it scored: ``fn`` returns a number or ``(number,
        metrics)``; a reward that fails scores ``(0.0, {})``."""
        start = time.monotonic()
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(ScoringUnavailable),
                stop=stop_after_attempt(1 + RETRIES),
                wait=wait_exponential(multiplier=RETRY_WAIT_S, max=10 * RETRY_WAIT_S),
                before_sleep=lambda state: log.warning(
                    "a reward's infrastructure failed "
                    f"({state.outcome and state.outcome.exception()}); trying again"
                ),
                reraise=True,
            ):
                with attempt:
                    return await self._score(fn, example, completion)
        except ScoringUnavailable as e:
            raise ScoringUnavailable(
                f"a reward could not be scored {1 + RETRIES} times: {e}\nThe run "
                "stops rather than train on zeros; "
                "fix the cause above and resume the run (ckpt.resume=latest)"
            ) from e
        finally:
            self.seconds += time.monotonic() - start
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def _score(
        self, fn: Callable[[dict, str], Any], example: dict[str, Any], completion: str
    ) -> tuple[float, dict]:
        async with self.limit:
            try:
                value = await self._run(fn, (example, completion), False, self.timeout_s)
            except ScoringUnavailable:
                raise  # not the completion's fault: score() retries it, then stops the run
            # past our deadline, or the reward's own (asyncrl.rewards kills its process)
            except TimeoutError as e:
                self.timeouts += 1
                log.warning(f"reward timed out ({e or f'after {self.timeout_s}s'}); scoring 0")
                return 0.0, {}
            # reward code is untrusted: any failure, its worker's death included, scores 0
            except Exception as e:
                self.errors += 1
                log.warning(f"reward raised {type(e).__name__}: {e}; scoring 0")
                return 0.0, {}
        metrics: dict = {}
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
            value, metrics = value
        try:
            value = float(value)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            self.errors += 1
            log.warning("reward returned a non-finite or non-numeric value; scoring 0")
            return 0.0, {}
        return value, metrics

    async def episode(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any | None:
        """``await fn(*args)`` (an environment's episode) on the runner's event loop; None, counted in
        ``rollout/episode_errors``, past ``timeout_s`` or when its worker process died on every attempt. Any
        other error is raised: the episode's own code reports its failures in what it returns."""
        try:
            return await self._run(fn, args, True, timeout_s)
        except (TimeoutError, WorkerLost) as e:
            self.episode_errors += 1
            log.warning(
                f"an episode failed ({type(e).__name__}: {e or f'past {timeout_s:.0f}s'}); scoring 0"
            )
            return None

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` where the rewards run (an environment preparing what they need), no deadline; raises
        what it raises."""
        return await self._run(fn, args, False, None)

    async def _run(self, fn: Callable[..., Any], args: tuple, on_loop: bool, timeout_s: float | None) -> Any:
        """``fn(*args)`` on the runner, sent again up to ``lost_retries`` times if its worker process dies;
        raises ``TimeoutError`` past ``timeout_s`` (the call abandoned)."""
        for attempt in range(1 + self.lost_retries):
            future = self.runner.submit(fn, args, on_loop)
            try:
                await self.runner.started(future)
                done, _ = await asyncio.wait({future}, timeout=timeout_s)
            # the group was cancelled (stale): its call's result is not wanted
            except asyncio.CancelledError:
                future.cancel()
                raise
            if not done:
                self.runner.abandon(future)
                raise TimeoutError()
            try:
                return future.result()
            except WorkerLost as e:
                if attempt == self.lost_retries:
                    raise
                log.warning(f"{e}; sending its call again")
        raise AssertionError("unreachable: the last attempt returns or raises")

    def count(self, counts: dict[str, int]) -> None:
        """Add what an environment counted itself (``rollout/<name>`` in the step's metrics)."""
        self.causes.update(counts)

    def take_counts(self) -> dict[str, int]:
        counts = {"rollout/reward_errors": self.errors, "rollout/reward_timeouts": self.timeouts}
        if self.episode_errors:
            counts["rollout/episode_errors"] = self.episode_errors
        counts |= {f"rollout/{name}": n for name, n in sorted(self.causes.items()) if n}
        self.errors = self.timeouts = self.episode_errors = 0
        self.causes.clear()
        return counts

    def take_seconds(self) -> float:
        """The rewards' wall time summed over the calls since the last time (a timing, kept out of the counts
        that results such as an eval's metrics.json record)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    async def close(self) -> None:
        await self.runner.close()
