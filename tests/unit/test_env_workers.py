"""Environments in worker processes (asyncrl.workers.pool): a reward that blocks stalls neither the event
loop nor the other rewards; a worker that dies is replaced and its call sent again, then counted; the pool
grows under load; rewards are the same numbers as in the orchestrator's process."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from asyncrl.config.orchestrator import EnvSpec
from asyncrl.rollouts.answers import ChatOut, ChoiceOut
from asyncrl.rollouts.context import RolloutContext, Sampling
from asyncrl.utils.errors import ScoringUnavailable
from asyncrl.workers.pool import EnvWorkers
from asyncrl.workers.scoring import Scorer
from asyncrl.workers.threads import Threads
from helpers.misbehaving_env import AsyncReward, Misbehaving

EXAMPLE = {"id": "x", "text": "hello world"}


def specs(**args) -> dict[str, EnvSpec]:
    return {"bad": EnvSpec(type="helpers.misbehaving_env:Misbehaving", args=args)}


class LagMeter:
    """The event loop's worst lateness: a 5 ms timer, and how late each tick came."""

    def __init__(self):
        self.worst = 0.0
        self.task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self):
        while True:
            start = time.monotonic()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, time.monotonic() - start - 0.005)


async def warm(scorer: Scorer, env) -> None:
    """Wait until the workers are up (each builds its environments first)."""
    assert await scorer.score(env.reward, EXAMPLE, "dlrow olleh") == 1.0


def score_once(tmp_path, completion: str, max_workers: int = 1) -> float:
    """One reward of ``completion`` in a fresh pool of one worker (of at most ``max_workers``)."""
    env = Misbehaving("bad", tmp_path)

    async def main():
        scorer = Scorer(EnvWorkers(specs(), tmp_path, 1, max_workers, 1), timeout_s=60)
        try:
            return await scorer.score(env.reward, EXAMPLE, completion)
        finally:
            await scorer.close()

    return asyncio.run(main())


def test_rewards_run_in_worker_processes_and_are_the_same_numbers(tmp_path):
    env = Misbehaving("bad", tmp_path)
    completions = ["dlrow olleh", "dlrow", "", "hello world", "x" * 40, "dlrow olleh\n"]

    async def main(runner):
        scorer = Scorer(runner, timeout_s=60)
        try:
            pids = {await scorer.score(env.reward, EXAMPLE, "pid") for _ in range(4)}
            return [await scorer.score(env.reward, EXAMPLE, c) for c in completions], pids
        finally:
            await scorer.close()

    in_workers, pids = asyncio.run(main(EnvWorkers(specs(), tmp_path, 1, 1, 2)))
    in_process, here = asyncio.run(main(Threads(2)))
    assert in_workers == in_process == [env.reward(EXAMPLE, c) for c in completions]  # bit for bit
    assert here == {float(os.getpid())} and len(pids) == 1 and pids != here


def test_a_blocking_reward_stalls_neither_the_event_loop_nor_other_rewards(tmp_path):
    """Rewards that block 1 s (a plain one, and one that calls time.sleep inside ``async def``) beside 40
    quick ones: the quick ones finish long before the slow ones, the event loop stays on time, and the
    blocking rewards score what they return (the orchestrator's threads scored an ``async def`` reward 0)."""
    env = Misbehaving("bad", tmp_path)

    async def main():
        scorer = Scorer(EnvWorkers(specs(), tmp_path, 2, 2, 4), timeout_s=30)
        try:
            await asyncio.gather(warm(scorer, env), warm(scorer, env))
            meter = LagMeter()
            start = time.monotonic()
            quick_done: list[float] = []

            async def quick():
                score = await scorer.score(env.reward, EXAMPLE, "dlrow olleh")
                quick_done.append(time.monotonic() - start)
                return score

            slow = [
                scorer.score(env.reward, EXAMPLE, "sleep"),
                scorer.score(env.async_reward, EXAMPLE, "async-sleep"),
            ]
            scores = await asyncio.gather(*slow, *(quick() for _ in range(40)))
            return scores, quick_done, time.monotonic() - start, meter.worst, scorer.take_counts()
        finally:
            await scorer.close()

    scores, quick_done, elapsed, lag, counts = asyncio.run(main())
    assert scores == [1.0] * 42 and counts == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 0}
    assert elapsed >= 1.0 and max(quick_done) < 0.5, quick_done  # the quick ones did not wait for the slow
    assert lag < 0.1, lag  # an `async def` reward blocking its loop for 1 s blocks a worker's, not this one


def test_a_worker_has_the_environment_its_pool_had_at_its_start(tmp_path, monkeypatch):
    """Workers are forks of one server process that outlives a pool: each still starts with the environment
    of the process that started it, as a fresh interpreter would, not the server's."""
    seen = []
    for number in ("1", "2"):
        monkeypatch.setenv("ASYNCRL_TEST_NUMBER", number)
        seen.append(score_once(tmp_path, "env"))
    assert seen == [1.0, 2.0]


def test_a_worker_that_dies_is_replaced_and_its_call_sent_again_then_counted(tmp_path):
    env = Misbehaving("bad", tmp_path)

    async def main():
        runner = EnvWorkers(specs(), tmp_path, 1, 2, 2)
        scorer = Scorer(runner, timeout_s=30, lost_retries=1)
        try:
            await warm(scorer, env)
            # dies on the first try, scores on the second; the quick rewards beside it are not lost
            once = await asyncio.gather(
                scorer.score(env.reward, EXAMPLE, "exit-once"),
                *(scorer.score(env.reward, EXAMPLE, "dlrow olleh") for _ in range(8)),
            )
            first = (scorer.take_counts(), runner.take_stats())
            always = await scorer.score(env.reward, EXAMPLE, "exit")  # dies on every try: scores 0, counted
            after = await scorer.score(env.reward, EXAMPLE, "dlrow olleh")  # the pool works on
            return once, first, always, after, scorer.take_counts(), runner.take_stats()
        finally:
            await scorer.close()

    once, (counts1, stats1), always, after, counts2, stats2 = asyncio.run(main())
    assert once == [0.5] + [1.0] * 8
    assert counts1 == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 0}
    assert stats1["env_workers/restarts"] == 1 and stats1["env_workers/workers"] >= 1
    assert always == 0.0 and after == 1.0
    assert counts2 == {"rollout/reward_errors": 1, "rollout/reward_timeouts": 0}
    assert stats2["env_workers/restarts"] == 2  # the first try and the one retry
    assert stats2["time/env_workers_cpu_s"] > 0


def test_the_pool_grows_under_sustained_load_up_to_its_max_and_not_on_a_burst(tmp_path):
    """40 quick rewards at once clear on the one worker sooner than another could start (each takes 0.5 s to
    build its environments here): none starts. Ten 1 s rewards keep its one thread busy: workers start, one
    at a time, up to max, and the ten finish sooner than one after another; a reward's wait in the queue does
    not count against its deadline (2 s here)."""
    env = Misbehaving("bad", tmp_path)

    async def main():
        runner = EnvWorkers(specs(start_s=0.5), tmp_path, 1, 3, 1)
        scorer = Scorer(runner, timeout_s=2.0)
        try:
            await warm(scorer, env)
            quick = await asyncio.gather(
                *(scorer.score(env.reward, EXAMPLE, "dlrow olleh") for _ in range(40))
            )
            after_burst = runner.take_stats()
            start = time.monotonic()
            slow = await asyncio.gather(*(scorer.score(env.reward, EXAMPLE, "sleep") for _ in range(10)))
            return (
                quick + slow,
                after_burst,
                time.monotonic() - start,
                runner.take_stats(),
                scorer.take_counts(),
            )
        finally:
            await scorer.close()

    scores, after_burst, elapsed, stats, counts = asyncio.run(main())
    assert scores == [1.0] * 50 and counts == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 0}
    assert after_burst["env_workers/workers"] == 1 and after_burst["env_workers/queued"] == 0
    assert stats["env_workers/workers"] == 3 and elapsed < 10.0 - 1.0, (stats, elapsed)


def test_a_worker_that_cannot_build_its_environments_stops_the_run_with_the_cause(tmp_path, monkeypatch):
    from asyncrl.workers import scoring

    monkeypatch.setattr(scoring, "RETRY_WAIT_S", 0.01)
    env = Misbehaving("bad", tmp_path, {"fail_in_workers": True})  # builds here, not in a worker

    async def main():
        scorer = Scorer(EnvWorkers(specs(fail_in_workers=True), tmp_path, 1, 1, 1), timeout_s=30)
        try:
            with pytest.raises(ScoringUnavailable) as e:
                await scorer.score(env.reward, EXAMPLE, "dlrow olleh")
            return e.value
        finally:
            await scorer.close()

    error = asyncio.run(main())
    assert "cannot be built here" in str(error) and "could not be scored 3 times" in str(error)


def test_each_worker_copy_is_told_its_share(tmp_path):
    """Every environment in a worker is one of max_workers copies: per-process budgets (the sandbox pool)
    split."""
    assert score_once(tmp_path, "parts", max_workers=3) == 3.0
    # the orchestrator's own copy is whole
    assert Misbehaving("bad", tmp_path).reward(EXAMPLE, "parts") == 1.0


def test_a_workers_start_up_does_not_count_against_a_rewards_deadline(tmp_path):
    """A fresh worker takes seconds to import and build its environments; a reward's deadline is its own."""
    env = Misbehaving("bad", tmp_path)

    async def main():
        scorer = Scorer(EnvWorkers(specs(start_s=2.0), tmp_path, 1, 1, 1), timeout_s=0.5)
        try:
            return await scorer.score(env.reward, EXAMPLE, "dlrow olleh"), scorer.take_counts()
        finally:
            await scorer.close()

    value, counts = asyncio.run(main())
    assert (value, counts["rollout/reward_timeouts"]) == (1.0, 0)


class Replies:
    """Stands in for the sidecars: answers every chat with the given completions."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    async def chat(self, messages, n, temperature, top_p, max_tokens, seed, **truncation):
        return ChatOut([0], [ChoiceOut([1, 2], [-0.1, -0.2], t, "stop") for t in self.texts[:n]])


@pytest.mark.parametrize("where", ["env-worker", "thread"])
def test_an_async_reward_scores_through_the_episode_path(tmp_path, where):
    """The base episode scores each completion by ``scored``, which must await an ``async def`` reward."""
    env = AsyncReward("async", tmp_path)
    texts = ["dlrow olleh", "dlrow", "hello"]
    spec = {"async": EnvSpec(type="helpers.misbehaving_env:AsyncReward")}

    async def main():
        runner = EnvWorkers(spec, tmp_path, 1, 1, 2) if where == "env-worker" else Threads(2)
        scorer = Scorer(runner, timeout_s=60)
        ctx = RolloutContext(Replies(texts), scorer, Sampling(1.0, 1.0, 8), "m", "")
        try:
            rollouts = await env.rollouts(ctx, EXAMPLE, len(texts), 0)
            return [r.reward for r in rollouts], scorer.take_counts()
        finally:
            await scorer.close()

    rewards, counts = asyncio.run(main())
    expected = [asyncio.run(env.reward(EXAMPLE, t)) for t in texts]
    assert rewards == expected and expected[0] == 1.0
    assert counts["rollout/reward_errors"] == 0
