"""The rollout schedules' one interface: ``run(start)`` writes batches ``start .. max_steps - 1``.

The orchestrator builds one schedule at start (:func:`asyncrl.orchestrator.orchestrate.build_schedule`, from
``orchestrator.schedule``) and hands it a :class:`ScheduleContext`: the collaborators a schedule drives, and
nothing else of the orchestrator. ``step`` (:class:`StepSchedule`, the default, replayable) is below;
``continuous`` (:mod:`asyncrl.orchestrator.continuous`) keeps groups in flight all the time and cuts a batch
as soon as enough have finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from asyncrl.checkpoint import is_checkpoint_step
from asyncrl.config import Config
from asyncrl.envs import PromptSampler
from asyncrl.orchestrator.batch import BatchWriter
from asyncrl.orchestrator.group import GroupRunner
from asyncrl.orchestrator.relay import PolicyRelay


class RolloutSchedule(Protocol):
    async def run(self, start: int) -> None:
        """Write the batches of steps ``start`` to ``max_steps - 1``, checkpointing on the configured
        steps."""


@dataclass
class ScheduleContext:
    """What a schedule drives: where prompts come from, how a group is generated, the policy the sidecars
    serve, how a batch is written, and how its own state is checkpointed
    (``save_checkpoint(done, extra)``)."""

    cfg: Config
    sampler: PromptSampler
    groups: GroupRunner
    relay: PolicyRelay
    writer: BatchWriter
    save_checkpoint: Callable[[int, dict[str, Any] | None], None]


class StepSchedule:
    """Per step ``n``: make sure the sidecars serve an allowed policy (:mod:`asyncrl.transport.policy`), draw
    ``prompts_per_step`` prompts, generate ``group_size`` completions of each, and write the batch (scored,
    with group-relative advantages, zero-advantage groups dropped, packed) as ``rollouts/step_n`` with the
    policy versions that produced it. With ``async_level >= 1`` this runs while the trainer is still on step
    ``n - 1``: that overlap is where asynchronous RL gets its speed."""

    def __init__(self, ctx: ScheduleContext):
        self.ctx = ctx

    async def run(self, start: int) -> None:
        cfg = self.ctx.cfg
        for step in range(start, cfg.max_steps):
            await self.step(step)
            if is_checkpoint_step(step + 1, cfg.ckpt.interval, cfg.max_steps):
                self.ctx.save_checkpoint(step + 1, None)

    async def step(self, step: int) -> None:
        ctx = self.ctx
        _, waited, update_s = await ctx.relay.ensure(step)
        ctx.sampler.now = step
        draws = [ctx.sampler.draw() for _ in range(ctx.cfg.orchestrator.prompts_per_step)]
        t0 = time.monotonic()
        groups = await asyncio.gather(*(ctx.groups.run(step, i, d) for i, d in enumerate(draws)))
        gen_s = time.monotonic() - t0
        timing = {"time/generate_s": gen_s, "time/wait_policy_s": waited, "time/update_weights_s": update_s}
        await ctx.writer.write(step, list(groups), gen_s, timing)
