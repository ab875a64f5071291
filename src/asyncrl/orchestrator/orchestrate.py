"""``asyncrl orchestrate``: the data plane of an RL run (asyncio, CPU).

The orchestrator builds its collaborators once (the sidecar pool, the environments and their prompt sampler,
the reward guard, the policy relay, the group runner, the batch writer), then runs one rollout schedule
chosen by ``orchestrator.schedule`` (:mod:`asyncrl.orchestrator.schedule`: ``step``, replayable, or
``continuous``). The schedule writes ``rollouts/step_n`` for every step; the orchestrator checkpoints the
sampler's position with the schedule's own state, and shuts everything down in order.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from typing import Any

from asyncrl.checkpoint import resolve_resume
from asyncrl.config import Config
from asyncrl.config.compose import to_dict, to_yaml
from asyncrl.config.model import ModelConfig, is_local_path
from asyncrl.envs import PromptSampler, build_envs
from asyncrl.models.tokenizer_files import pad_token_id, vocabulary
from asyncrl.monitor import build_monitor
from asyncrl.orchestrator.batch import BatchWriter
from asyncrl.orchestrator.continuous import ContinuousSchedule
from asyncrl.orchestrator.group import GroupRunner
from asyncrl.orchestrator.looplag import LoopMonitor
from asyncrl.orchestrator.relay import PolicyRelay
from asyncrl.orchestrator.schedule import RolloutSchedule, ScheduleContext, StepSchedule
from asyncrl.orchestrator.teacher import Teacher
from asyncrl.paths import RunDir
from asyncrl.rollouts.client import InferencePool
from asyncrl.rollouts.context import rollout_context
from asyncrl.utils.atomic import atomic_dir
from asyncrl.utils.process import exit_wrapper, setup_logging
from asyncrl.workers.pool import build_runner
from asyncrl.workers.scoring import Scorer

log = logging.getLogger("asyncrl.orchestrator")


def check_same_tokenizer(cfg: Config) -> None:
    """Online distillation compares token ids: a teacher with another vocabulary would score other tokens
    than the student sampled. Checked when the teacher is a local directory (a hub id may not be on this
    machine)."""
    teacher = str(cfg.distill.teacher)
    if not is_local_path(teacher):
        return
    if vocabulary(ModelConfig(name=teacher)) != vocabulary(cfg.model):
        raise ValueError(
            f"distill.teacher={teacher} has another tokenizer than the student "
            f"({cfg.model.tokenizer or cfg.model.name}); distillation compares "
            "token ids, so both must share one"
        )


def build_pool(cfg: Config) -> InferencePool:
    """The client of the sidecars at ``inference.urls`` (at least one)."""
    if not cfg.inference.urls:
        raise ValueError(
            "inference.urls is empty: start a sidecar (`asyncrl serve`) and pass its URL, "
            "or use `asyncrl rl`, which does both"
        )
    oc = cfg.orchestrator
    return InferencePool(
        cfg.inference.urls,
        cfg.model.name,
        oc.request_timeout_s,
        oc.max_concurrency,
        cfg.inference.admin_token,
        {**oc.extra_body, "return_routed_experts": True} if oc.routed_experts else oc.extra_body,
        oc.request_retries,
        cfg.inference.startup_timeout_s,
    )


def build_teacher(cfg: Config) -> Teacher | None:
    """The teacher's client for online distillation (``distill.teacher``), or None without it."""
    if not cfg.distill.teacher:
        return None
    if not cfg.distill.url:
        raise ValueError(
            "distill.teacher is set but distill.url is empty: start the teacher or use `asyncrl rl`"
        )
    check_same_tokenizer(cfg)
    oc = cfg.orchestrator
    return Teacher(
        cfg.distill.url, cfg.distill.teacher, oc.request_timeout_s, oc.max_concurrency, oc.request_retries
    )


def build_sampler(cfg: Config, envs) -> PromptSampler:
    """The training prompts of every environment, drawn by weight (with the difficulty curriculum's
    skips)."""
    diff = cfg.orchestrator.difficulty
    weights = {n: s.weight for n, s in cfg.env.items()}
    return PromptSampler(
        envs, weights, "train", cfg.seed, diff.skip_steps, (diff.min_reward, diff.max_reward)
    )


def build_schedule(ctx: ScheduleContext, state: dict[str, Any] | None) -> RolloutSchedule:
    """The schedule ``orchestrator.schedule`` names; ``state``: a resumed checkpoint's (the continuous
    schedule's draws not yet trained)."""
    if ctx.cfg.orchestrator.schedule == "continuous":
        return ContinuousSchedule(ctx, state)
    return StepSchedule(ctx)


class Orchestrator:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run = RunDir(cfg.run_dir).create()
        (self.run.configs / "orchestrator.yaml").write_text(to_yaml(cfg))
        self.resume = resolve_resume(cfg, self.run)
        self.pool = build_pool(cfg)
        self.envs = build_envs(cfg.env, cfg.data_dir)
        self.sampler = build_sampler(cfg, self.envs)
        pad_id = pad_token_id(cfg.model)
        oc = cfg.orchestrator
        # the environments' rewards and episodes run in worker processes (orchestrator.env_workers)
        self.scorer = Scorer(
            build_runner(oc, cfg.env, cfg.data_dir), oc.reward_timeout_s, oc.env_workers.retries
        )
        # online distillation: the teacher's logprobs of every sampled token
        self.teacher = build_teacher(cfg)
        self.monitor = build_monitor(
            cfg.monitor,
            self.run.metrics_file("orchestrator"),
            "orchestrator",
            config=to_dict(cfg),
            resume_step=self.resume,
        )
        self.loop_monitor = LoopMonitor()
        self.relay = PolicyRelay(cfg, self.run, self.pool)
        counters = (self.sampler, self.scorer, self.pool, self.loop_monitor)
        writer = BatchWriter(cfg, self.run, self.envs, pad_id, self.monitor, counters, self.relay)
        ctx = rollout_context(cfg, self.pool, self.scorer)
        groups = GroupRunner(cfg, self.envs, ctx, self.pool, self.sampler, self.teacher)
        self.schedule_ctx = ScheduleContext(
            cfg, self.sampler, groups, self.relay, writer, self.save_checkpoint
        )

    def save_checkpoint(self, done: int, extra: dict[str, Any] | None = None) -> None:
        """The sampler's position after ``done`` steps, and the schedule's own state (``extra``)."""
        state = {"step": done, "sampler": self.sampler.state_dict(), **(extra or {})}
        with atomic_dir(self.run.checkpoint(done, "orchestrator"), digest=True) as tmp:
            (tmp / "state.json").write_text(json.dumps(state))

    def load_checkpoint(self, done: int) -> dict[str, Any]:
        state = json.loads((self.run.checkpoint(done, "orchestrator") / "state.json").read_text())
        self.sampler.load_state_dict(state["sampler"])
        return state

    async def run_loop(self) -> None:
        start, state = 0, None
        if self.resume is not None:
            state = self.load_checkpoint(self.resume)
            start = self.resume
            log.info(f"resuming at step {start}")
        schedule = build_schedule(self.schedule_ctx, state)
        # The collector's full passes stop the event loop for as long as they walk every object: 0.5-1 s with
        # 4,096 groups in flight (python benchmarks/orchestrator_scale.py --inflight 4096). Datasets,
        # tokenizer and modules, loaded now and kept for good, leave its sight; full passes come 100x rarer
        # (the young generations, where the requests' cyclic garbage dies, are collected at their usual
        # rate).
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, 1000)
        self.loop_monitor.start()
        try:
            await self.pool.wait_healthy(self.cfg.inference.startup_timeout_s)
            if self.cfg.orchestrator.health_check_s:
                self.pool.watch_health(self.cfg.orchestrator.health_check_s)
            await self.relay.start()
            await schedule.run(start)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop what :meth:`run_loop` started, in order: the relay, the loop monitor, the environments (their
        servers and sessions, their worker processes), the metrics sinks, the clients."""
        self.relay.stop()
        self.loop_monitor.stop()
        for env in self.envs.values():
            await env.close()
        await self.scorer.close()
        self.monitor.close()
        await self.pool.close()
        if self.teacher is not None:
            await self.teacher.close()


@exit_wrapper("orchestrator")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    setup_logging("orchestrator")
    asyncio.run(Orchestrator(cfg).run_loop())
