"""A reward that raises, hangs or returns garbage scores 0 and is counted; the step goes on."""

import asyncio
import time

import pytest

from asyncrl.workers.scoring import Scorer
from asyncrl.workers.threads import Threads


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
        s = Scorer(Threads(4), timeout_s=0.3)
        start = time.monotonic()
        scores = await asyncio.gather(*(s.score(f, {}, "x") for f in (good, raises, hangs, nan, text, good)))
        return (
            scores,
            s.take_counts(),
            time.monotonic() - start,
            s.take_counts(),
            s.take_seconds(),
            s.take_seconds(),
        )

    scores, counts, elapsed, after, score_s, score_s_after = asyncio.run(main())
    assert scores == [0.75, 0.0, 0.0, 0.0, 0.0, 0.75]
    assert counts == {"rollout/reward_errors": 3, "rollout/reward_timeouts": 1}
    assert elapsed < 5  # the hung reward did not block the others
    assert after == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 0}
    # the hung one waited out its 0.3 s; summed over six
    assert 0.3 <= score_s < 6 * 5 and score_s_after == 0.0


def test_hung_rewards_do_not_shrink_the_worker_pool_and_threads_are_reused():
    async def main():
        s = Scorer(Threads(2), timeout_s=0.3)
        hung = await asyncio.gather(s.score(hangs, {}, "x"), s.score(hangs, {}, "x"))  # both workers stuck
        start = time.monotonic()
        scores = await asyncio.gather(*(s.score(good, {}, "x") for _ in range(50)))
        return hung, scores, time.monotonic() - start, s.runner.threads

    hung, scores, elapsed, threads = asyncio.run(main())
    assert hung == [0.0, 0.0] and scores == [0.75] * 50
    assert elapsed < 2  # not one timeout per call: the stuck workers were replaced
    assert threads == 4  # two, and one in place of each stuck one; the 50 calls reused them


def test_a_failing_reward_infrastructure_is_retried_then_stops_the_run(monkeypatch):
    """A sandbox that cannot start is not the completion's fault: tried again (a transient failure scores as
    usual), and when it persists the error stops the run with its cause, instead of training on zeros."""
    from asyncrl.sandbox import SandboxUnavailable
    from asyncrl.workers import scoring

    monkeypatch.setattr(scoring, "RETRY_WAIT_S", 0.01)
    calls = {"flaky": 0, "broken": 0}

    def flaky(example, completion):
        calls["flaky"] += 1
        if calls["flaky"] == 1:
            raise SandboxUnavailable("the sandbox did not start: out of processes")
        return 0.5

    def broken(example, completion):
        calls["broken"] += 1
        raise SandboxUnavailable("the sandbox did not start: No permissions to create new namespace")

    async def main():
        s = Scorer(Threads(2), timeout_s=5)
        value = await s.score(flaky, {}, "x")
        with pytest.raises(scoring.ScoringUnavailable) as e:
            await s.score(broken, {}, "x")
        return value, e.value, s.take_counts()

    value, error, counts = asyncio.run(main())
    assert value == 0.5 and calls == {"flaky": 2, "broken": 1 + scoring.RETRIES}
    assert "could not be scored 3 times" in str(error) and "No permissions to create new namespace" in str(
        error
    )
    assert "resume the run" in str(error)
    assert counts == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 0}  # nothing scored 0


def test_a_run_whose_rewards_all_fail_stops_after_the_configured_steps():
    """Every reward of a step failing (raised, timed out) max_failed_reward_steps steps in a row stops the
    run, naming the counts; a step with one reward that worked starts the count again."""
    from types import SimpleNamespace

    from asyncrl.orchestrator.batch import BatchWriter

    writer = SimpleNamespace(failed_steps=0, oc=SimpleNamespace(max_failed_reward_steps=3))
    failed = {"rollout/reward_errors": 3, "rollout/reward_timeouts": 1}
    for step in range(2):
        assert BatchWriter.check_rewards(writer, step, failed, samples=4) == failed
    assert BatchWriter.check_rewards(writer, 2, {"rollout/reward_errors": 3}, samples=4)  # one reward worked
    assert writer.failed_steps == 0
    for step in range(3, 5):
        BatchWriter.check_rewards(writer, step, failed, samples=4)
    with pytest.raises(
        RuntimeError, match=r"step 5: every reward failed in the last 3 steps .*reward_errors"
    ):
        BatchWriter.check_rewards(writer, 5, failed, samples=4)
    writer = SimpleNamespace(failed_steps=0, oc=SimpleNamespace(max_failed_reward_steps=0))
    for step in range(10):  # 0: never
        BatchWriter.check_rewards(writer, step, failed, samples=4)
