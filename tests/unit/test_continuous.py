"""The continuous schedule's bookkeeping: staleness, stale groups dropped or cancelled and counted, and the
state a checkpoint holds (pure parts, no server)."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

from asyncrl.envs.mixture import Draw
from asyncrl.orchestrator.continuous import ContinuousSchedule, draw_seed, is_stale
from asyncrl.orchestrator.group import Group, rollout_extras, staleness
from asyncrl.orchestrator.schedule import ScheduleContext


def group(index: int, versions: dict[int, int]) -> Group:
    return Group("env", {"id": index}, [], [1.0, -1.0], index, Counter(versions))


def schedule(max_off: int = 2) -> ContinuousSchedule:
    oc = SimpleNamespace(
        max_inflight=4,
        prompts_per_step=2,
        max_off_policy_steps=max_off,
        weights_poll_s=0.01,
        max_concurrency=64,
    )
    writer = SimpleNamespace(select=lambda groups: (groups, 0))
    cfg = SimpleNamespace(orchestrator=oc)
    ctx = ScheduleContext(cfg, None, None, None, writer, None)  # type: ignore[arg-type]
    return ContinuousSchedule(ctx, None)


def test_staleness_is_counted_over_tokens():
    groups = [group(0, {3: 30, 5: 10}), group(1, {5: 60})]
    assert staleness(5, groups) == {"async/staleness_mean": 2 * 30 / 100, "async/staleness_max": 2}
    assert staleness(5, []) == {"async/staleness_mean": 0.0, "async/staleness_max": 0}


def test_is_stale_bound():
    assert not is_stale(3, 5, 2) and is_stale(2, 5, 2) and not is_stale(5, 5, 0)


def test_draw_seeds_differ_by_index_and_run_seed():
    seeds = {draw_seed(0, i) for i in range(10_000)} | {draw_seed(1, i) for i in range(10_000)}
    assert len(seeds) == 20_000 and all(0 <= s < 2**63 for s in seeds)


def test_stale_groups_are_dropped_and_counted_and_hopeless_ones_cancelled():
    async def scenario():
        s = schedule(max_off=2)
        s.buffer = [group(0, {1: 5, 4: 5}), group(1, {3: 8}), group(2, {5: 8})]  # for step 5: 0 is stale
        hopeless = asyncio.create_task(asyncio.sleep(60))
        fine = asyncio.create_task(asyncio.sleep(60))
        s.inflight = {hopeless: (7, Draw("env", {"id": 7}), 2), fine: (8, Draw("env", {"id": 8}), 4)}
        s.drop_stale(5)
        await asyncio.sleep(0)
        assert [g.index for g in s.buffer] == [1, 2]
        assert sorted(s.dropped) == [0, 7] and hopeless.cancelled() and not fine.cancelled()
        assert s.counts["rollout/stale_dropped"] == 2 and s.counts["rollout/stale_cancelled"] == 1
        # a checkpoint now holds every draw not yet trained: buffered and in flight, by index
        assert [d["index"] for d in s.state()["redo"]] == [1, 2, 8]
        fine.cancel()

    asyncio.run(scenario())


def test_a_group_arriving_stale_is_dropped_on_arrival():
    async def scenario():
        s = schedule(max_off=1)
        s.cutting = 4

        async def finished(g):
            return g

        for g in (group(0, {2: 4}), group(1, {3: 4})):
            task = asyncio.create_task(finished(g))
            s.inflight[task] = (g.index, Draw("env", {}), 0)
            await task
            s.finished.append(task)
        s.harvest()
        assert [g.index for g in s.buffer] == [1] and s.dropped == [0]
        assert s.counts["rollout/stale_dropped"] == 1

    asyncio.run(scenario())


def test_rollout_extras_spread_the_table_over_groups():
    def g(env, rewards, version):
        # the first: one turn, no stop
        info = [{"stop": "max_turns"} if i else {} for i in range(len(rewards))]
        rollouts = [
            SimpleNamespace(text=f"{env}{i}", reward=r, completion_tokens=i + 1, info=info[i])
            for i, r in enumerate(rewards)
        ]
        mean = sum(rewards) / len(rewards)
        return Group(env, {"id": env}, rollouts, [r - mean for r in rewards], 0, Counter({version: 5}))

    groups = [g("a", [1.0, 0.0, 1.0], 4), g("b", [0.5, 0.0, 0.0], 3)]
    table, dists = rollout_extras(5, groups, lambda grp: f"prompt {grp.env}", 3, True, True)
    assert table is not None and dists is not None
    # round robin: the first rollout of each group, then the second of the first
    assert [(r["env"], r["completion"]) for r in table] == [("a", "a0"), ("b", "b0"), ("a", "a1")]
    assert table[1] == {
        "step": 5,
        "env": "b",
        "id": "b",
        "prompt": "prompt b",
        "completion": "b0",
        "reward": 0.5,
        "advantage": groups[1].advantages[0],
        "policy_version": 3,
        "completion_tokens": 1,
        "stop": "",  # every row has every column (W&B's table); a one-turn episode's are empty
        "transcript": "",
    }
    assert table[2]["stop"] == "max_turns"
    assert dists["rollout/reward_hist"] == [1.0, 0.0, 1.0, 0.5, 0.0, 0.0]
    assert dists["async/staleness_hist"] == [1, 1, 1, 2, 2, 2]
    assert dists["rollout/completion_len_hist"] == [1, 2, 3, 1, 2, 3]
    assert rollout_extras(5, groups, str, 3, False, False) == (None, None)
