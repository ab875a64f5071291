"""A reward that raises, hangs or returns garbage scores 0 and is counted; the step goes on."""

import asyncio
import time

from asyncrl.orchestrator.scoring import Scorer


def good(ex, c):
    return 0.75


def raises(ex, c):
    raise KeyError("boom")


def hangs(ex, c):
    time.sleep(3600)


def nan(ex, c):
    return float("nan")


def text(ex, c):
    return "not a number"


def test_failures_score_zero_and_are_counted():
    async def main():
        s = Scorer(workers=4, timeout_s=0.3)
        start = time.monotonic()
        scores = await asyncio.gather(*(s.score(f, {}, "x") for f in (good, raises, hangs, nan, text, good)))
        return scores, s.take_counts(), time.monotonic() - start, s.take_counts()

    scores, counts, elapsed, after = asyncio.run(main())
    assert scores == [0.75, 0.0, 0.0, 0.0, 0.0, 0.75]
    assert counts == {"rollout/reward_errors": 3, "rollout/reward_timeouts": 1}
    assert elapsed < 5  # the hung reward did not block the others
    assert after == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 0}
