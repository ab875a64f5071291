"""The continuous schedule (``orchestrator.schedule=continuous``): rollouts that never wait for the slowest.

Up to ``orchestrator.max_inflight`` groups are in flight at all times, across all sidecars. A finished group
goes to a buffer (groups without learning signal are dropped on arrival, counted); batch ``n`` is cut as soon
as the buffer holds ``prompts_per_step`` groups and written as ``rollouts/step_n``, and the freed slots are
refilled at once. New weights are relayed to the sidecars the moment the trainer publishes them, while
requests run (in-flight updates), so a completion may span several policies; the versions of every group's
tokens are counted (:data:`asyncrl.rollouts.answers.TOKEN_VERSIONS`). A group with a token more than
``max_off_policy_steps`` policies older than the batch it would join is dropped (``rollout/stale_dropped``),
and an in-flight group that started before that bound is cancelled. Batch ``n`` is cut only once policy
``n - async_level`` is loaded, which bounds how far the orchestrator runs ahead of the trainer.

Resume: every draw has an index; a checkpoint after batch ``n`` holds the sampler's position and the draws
not yet trained (in flight or buffered), which a resumed run generates again first (with their own seeds).
Each ``rollouts/step_n/meta.json`` lists the indices it holds, and those dropped, so every draw is trained
at most once and none is lost across a kill and resume. Which groups finish first depends on timing: this
schedule is not replayable bit for bit; ``step`` is.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, deque
from typing import Any

from asyncrl.checkpoint import is_checkpoint_step
from asyncrl.envs.mixture import Draw
from asyncrl.orchestrator.group import Group
from asyncrl.orchestrator.schedule import ScheduleContext
from asyncrl.transport.base import transport_of
from asyncrl.transport.policy import min_policy

log = logging.getLogger("asyncrl.orchestrator")

FILL_CHUNK = 64  # groups started per turn of the event loop (see ContinuousSchedule.fill)


def draw_seed(seed: int, index: int) -> int:
    """The sampling seed of draw ``index`` (63 bits): the same draw gets the same seed when it is generated
    again after a resume; a stream apart from the step schedule's and eval's seeds."""
    digest = hashlib.blake2b(f"{seed}:draw:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def is_stale(first_version: int, step: int, max_off_policy_steps: int) -> bool:
    """Whether tokens from policy ``first_version`` are too old for batch ``step`` (pure)."""
    return step - first_version > max_off_policy_steps


class ContinuousSchedule:
    """Implements :class:`~asyncrl.orchestrator.schedule.RolloutSchedule`; ``state``: what a checkpoint of a
    previous run of it held (:meth:`state`), or None."""

    def __init__(self, ctx: ScheduleContext, state: dict[str, Any] | None):
        self.ctx, self.oc = ctx, ctx.cfg.orchestrator
        oc = self.oc
        self.max_inflight = oc.max_inflight or 2 * oc.prompts_per_step
        if oc.max_concurrency < self.max_inflight:  # the cap is silent otherwise: only throughput shows it
            log.warning(
                f"orchestrator.max_concurrency={oc.max_concurrency} requests < {self.max_inflight} groups "
                "in flight: groups beyond it wait for a request slot, and the sidecars see fewer sequences "
                "than they could batch; raise orchestrator.max_concurrency (an environment that sends one "
                "request per completion needs group_size per group)"
            )
        state = state or {}
        self.next_index: int = state.get("next_draw", 0)
        self.redo: deque[tuple[int, Draw]] = deque(
            (d["index"], Draw(d["env"], d["example"], d.get("row", -1))) for d in state.get("redo", [])
        )
        # task -> (index, draw, version at start)
        self.inflight: dict[asyncio.Task, tuple[int, Draw, int]] = {}
        self.finished: list[asyncio.Task] = []  # done, not yet filed
        self.changed = asyncio.Event()  # a group finished or a policy was loaded
        self.buffer: list[Group] = []  # finished groups with learning signal, oldest first
        self.cutting = 0  # the batch being filled
        self.counts: Counter = Counter()  # since the last batch
        self.dropped: list[int] = []  # draw indices dropped since the last batch
        self.update_s = 0.0

    # -- state ------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a checkpoint holds: the next draw index and every draw drawn but not yet trained."""
        waiting = [(i, d) for i, d, _ in self.inflight.values()]
        waiting += [(g.index, Draw(g.env, g.example, g.row)) for g in self.buffer] + list(self.redo)
        return {
            "schedule": "continuous",
            "next_draw": self.next_index,
            "redo": [
                {"index": i, "env": d.env, "example": d.example, "row": d.row}
                for i, d in sorted(waiting, key=lambda x: x[0])
            ],
        }

    # -- generation -------------------------------------------------------------------------------------
    def fill(self) -> bool:
        """Start groups until ``max_inflight`` are in flight: draws to generate again first, then new ones.
        Finished groups beyond one batch (while the next batch waits for its policy) count as in flight,
        so a slow trainer stops generation instead of growing a buffer that would only go stale.

        At most ``FILL_CHUNK`` per call (True when more are due): every task started here takes its first
        step in the same turn of the event loop, and a thousand of them at once (a batch cut with 4,096 in
        flight) hold the loop for about a third of a second
        (``python benchmarks/orchestrator_scale.py --inflight 4096``)."""
        surplus = max(0, len(self.buffer) - self.oc.prompts_per_step)
        for _ in range(FILL_CHUNK):
            if len(self.inflight) + surplus >= self.max_inflight:
                return False
            if self.redo:
                index, draw = self.redo.popleft()
            else:
                index, draw = self.next_index, self.ctx.sampler.draw()
                self.next_index += 1
            seed = draw_seed(self.ctx.cfg.seed, index)
            task = asyncio.create_task(self.ctx.groups.run(-1, index, draw, seed=seed))
            self.inflight[task] = (index, draw, self.ctx.relay.sent_version())
            task.add_done_callback(self._done)
        return len(self.inflight) + surplus < self.max_inflight

    def _done(self, task: asyncio.Task) -> None:
        if not task.cancelled():
            self.finished.append(task)
            self.changed.set()

    def harvest(self) -> None:
        """File finished groups: into the buffer, or dropped (no learning signal, too stale), counted."""
        done, self.finished = self.finished, []
        for task in done:
            if task not in self.inflight:  # cancelled as stale after it finished
                continue
            index, _, _ = self.inflight.pop(task)
            # an episode that failed after the pool's retries fails the run, as in step mode
            group = task.result()
            kept, _ = self.ctx.writer.select([group])
            if not kept:
                self.counts["rollout/dropped_groups"] += 1
                self.dropped.append(index)
            elif is_stale(group.min_version, self.cutting, self.oc.max_off_policy_steps):
                self.counts["rollout/stale_dropped"] += 1
                self.dropped.append(index)
            else:
                self.buffer.append(group)

    def drop_stale(self, step: int) -> None:
        """Before cutting batch ``step``: drop buffered groups now too old, cancel in-flight ones that cannot
        make it (every token of a request is at least as new as the policy it started on)."""
        bound = self.oc.max_off_policy_steps
        fresh = []
        for g in self.buffer:
            if is_stale(g.min_version, step, bound):
                self.counts["rollout/stale_dropped"] += 1
                self.dropped.append(g.index)
            else:
                fresh.append(g)
        self.buffer = fresh
        for task, (index, _, started) in list(self.inflight.items()):
            if is_stale(started, step, bound):
                task.cancel()
                del self.inflight[task]
                self.counts["rollout/stale_dropped"] += 1
                self.counts["rollout/stale_cancelled"] += 1
                self.dropped.append(index)

    async def relay(self) -> None:
        """Load each new policy on the sidecars as soon as the trainer publishes it (the newest; with a
        GPU-to-GPU transport every version in order, since each one sent must be received)."""
        relay = self.ctx.relay
        in_order = transport_of(self.ctx.cfg).streamed
        while True:
            available = relay.published()
            target = relay.version + 1 if in_order else max([0, *available])
            if target > relay.version and target in available:
                self.update_s += await relay.load(target)
                self.counts["async/policy_updates"] += 1
                self.changed.set()
            else:
                await asyncio.sleep(self.oc.weights_poll_s)

    async def wait_for(self, ready, relay: asyncio.Task, what: str) -> float:
        """Keep generating until ``ready()``; the seconds it took. Fails if the relay failed, or after
        ``orchestrator.wait_timeout_s`` without a group finishing or a policy arriving."""
        start = last = time.monotonic()
        while True:
            self.harvest()
            if ready():
                return time.monotonic() - start
            if self.fill():
                await asyncio.sleep(0)  # let the groups just started send their requests, then start more
                continue
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=self.oc.weights_poll_s * 50)
                last = time.monotonic()
            except TimeoutError:
                if time.monotonic() - last > self.oc.wait_timeout_s:
                    raise TimeoutError(
                        f"no group finished and no policy arrived for {self.oc.wait_timeout_s:.0f}s while "
                        f"waiting for {what}; is the trainer running?"
                    ) from None
            if relay.done():
                relay.result()  # raises what stopped it

    async def run(self, start: int) -> None:
        ctx, oc = self.ctx, self.oc
        relay = asyncio.create_task(self.relay())
        # a failed relay wakes the wait that reports it
        relay.add_done_callback(lambda _: self.changed.set())
        last_cut = time.monotonic()
        try:
            for step in range(start, ctx.cfg.max_steps):
                self.cutting = ctx.sampler.now = step
                need = min_policy(step, ctx.cfg.async_level)
                waited = await self.wait_for(
                    lambda need=need: ctx.relay.version >= need, relay, f"policy {need}"
                )
                self.drop_stale(step)
                await self.wait_for(lambda: len(self.buffer) >= oc.prompts_per_step, relay, f"batch {step}")
                now = time.monotonic()
                await self.cut(step, now - last_cut, waited)
                last_cut = now
                if is_checkpoint_step(step + 1, ctx.cfg.ckpt.interval, ctx.cfg.max_steps):
                    ctx.save_checkpoint(step + 1, self.state())
                self.fill()
        finally:
            relay.cancel()
            for task in self.inflight:
                task.cancel()
            await asyncio.gather(relay, *self.inflight, return_exceptions=True)

    async def cut(self, step: int, gen_s: float, waited: float) -> None:
        """Write the oldest ``prompts_per_step`` buffered groups as batch ``step``, with what was dropped and
        counted since the last batch."""
        n = self.oc.prompts_per_step
        groups, self.buffer = self.buffer[:n], self.buffer[n:]
        counts, self.counts = self.counts, Counter()
        metrics: dict[str, float] = {
            "rollout/stale_dropped": counts["rollout/stale_dropped"],
            "rollout/stale_cancelled": counts["rollout/stale_cancelled"],
            "rollout/inflight": len(self.inflight),
            "rollout/buffered": len(self.buffer),
            "async/policy_updates": counts["async/policy_updates"],
        }
        meta = {
            "schedule": "continuous",
            "groups": [g.index for g in groups],
            "dropped": sorted(self.dropped),
        }
        timing = {
            "time/generate_s": gen_s,
            "time/wait_policy_s": waited,
            "time/update_weights_s": self.update_s,
        }
        await self.ctx.writer.write(
            step, groups, gen_s, timing, meta, metrics, dropped_before=counts["rollout/dropped_groups"]
        )
        self.dropped, self.update_s = [], 0.0
