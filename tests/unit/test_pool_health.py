"""A hung sidecar (answers nothing, connection open) leaves rotation by the health check, long before the
request timeout, and its in-flight request is answered by the other server; the loop-lag monitor sees a
blocked event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.orchestrator.looplag import LoopMonitor, lag_stats
from asyncrl.rollouts.client import InferencePool
from helpers.standin import build_standin, serve_standin


def test_a_hung_server_leaves_rotation_and_its_request_is_answered_elsewhere():
    apps = [build_standin(), build_standin()]
    apps[1].state.standin["hung"] = True
    with serve_standin(apps[0]) as a, serve_standin(apps[1]) as b:

        async def scenario() -> tuple[float, list[bool], int]:
            pool = InferencePool([a, b], "m", request_timeout_s=600, max_concurrency=8)
            pool.watch_health(0.2, misses=3)
            pool.inflight[0] = 1  # the least busy server is the hung one: the request goes there first
            start = time.monotonic()
            out = await pool.chat([{"role": "user", "content": "x"}], 2, 1.0, 1.0, 5, seed=1)
            took = time.monotonic() - start
            up = list(pool.up)
            await pool.close()
            apps[1].state.standin["hung"] = False  # its abandoned handlers end, so the server can stop
            return took, up, len(out.choices)

        took, up, n = asyncio.run(scenario())
    assert n == 2
    assert up == [True, False]
    assert apps[1].state.standin["requests"] == 1 and apps[0].state.standin["requests"] == 1
    assert took < 10, took  # three missed 0.2 s checks, then a retry; not the 600 s request timeout


def test_a_dying_server_leaves_rotation_on_a_weight_update_and_the_others_take_it():
    """A sidecar whose engine died answers 503 while it exits: the update goes on without it (it gets the
    policy when the launcher has restarted it), and its chat requests go to the other server."""
    apps = [build_standin(), build_standin()]
    apps[1].state.standin["dying"] = True
    with serve_standin(apps[0]) as a, serve_standin(apps[1]) as b:

        async def scenario() -> tuple[list[bool], list[int], int]:
            pool = InferencePool([a, b], "m", request_timeout_s=600, max_concurrency=8)
            await pool.update_weights("/nowhere", 3)
            up = list(pool.up)
            pool.up[1] = True  # back in rotation but still dying: a chat request there goes elsewhere
            pool.inflight[0] = 1
            out = await pool.chat([{"role": "user", "content": "x"}], 2, 1.0, 1.0, 5, seed=1)
            await pool.close()
            return up, pool.server_versions[:1], len(out.choices)

        up, versions, n = asyncio.run(scenario())
    assert up == [True, False]
    assert versions == [3] and apps[0].state.standin["version"] == 3
    assert n == 2 and apps[1].state.standin["requests"] == 1


def test_a_server_that_answers_again_comes_back():
    app = build_standin()
    with serve_standin(app) as url:

        async def scenario() -> list[list[bool]]:
            pool = InferencePool([url], "m", request_timeout_s=600, max_concurrency=8)
            pool.watch_health(0.1, misses=2)
            app.state.standin["hung"] = True
            seen = []
            for _ in range(100):
                await asyncio.sleep(0.05)
                if not pool.up[0]:
                    break
            seen.append(list(pool.up))
            app.state.standin["hung"] = False
            for _ in range(100):
                await asyncio.sleep(0.05)
                if pool.up[0]:
                    break
            seen.append(list(pool.up))
            await pool.close()
            return seen

        assert asyncio.run(scenario()) == [[False], [True]]


def test_lag_stats():
    assert lag_stats([]) == {"time/loop_lag_p99_ms": 0.0, "time/loop_lag_max_ms": 0.0}
    stats = lag_stats([0.001] * 99 + [0.5])
    assert stats["time/loop_lag_max_ms"] == pytest.approx(500)
    assert stats["time/loop_lag_p99_ms"] == pytest.approx(500)  # nearest rank: the 100th of 100
    assert lag_stats([0.001] * 200 + [0.5])["time/loop_lag_p99_ms"] == pytest.approx(1)


def test_the_loop_monitor_sees_a_blocked_loop_and_counts_cpu():
    async def scenario() -> tuple[dict, dict]:
        monitor = LoopMonitor(every_s=0.01)
        monitor.start()
        await asyncio.sleep(0.2)
        quiet = monitor.take()
        await asyncio.sleep(0.05)
        end = time.process_time() + 0.3
        while time.process_time() < end:  # a CPU-bound call on the loop: 0.3 s nobody else runs
            pass
        await asyncio.sleep(0.05)
        busy = monitor.take()
        monitor.stop()
        return quiet, busy

    quiet, busy = asyncio.run(scenario())
    assert busy["time/loop_lag_max_ms"] > 250
    assert busy["time/orchestrator_cpu_s"] >= 0.3
    assert quiet["time/loop_lag_max_ms"] < busy["time/loop_lag_max_ms"]
