"""Writing a batch: the groups worth training on, packed into ``rollouts/step_n`` with the policy versions of
their tokens, their samples file, and the step's metrics. Both schedules write every batch through
:meth:`BatchWriter.write`."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any

from asyncrl.config import Config
from asyncrl.config.invariants import truncates
from asyncrl.config.layout import data_parallel_ranks
from asyncrl.envs import Environment, PromptSampler
from asyncrl.monitor import extras_due
from asyncrl.orchestrator.advantages import FILTER_REASONS, drop_reason
from asyncrl.orchestrator.group import Group, rollout_extras, staleness
from asyncrl.orchestrator.looplag import LoopMonitor
from asyncrl.orchestrator.relay import PolicyRelay
from asyncrl.paths import RunDir
from asyncrl.rollouts.client import InferencePool
from asyncrl.rollouts.metrics import mean
from asyncrl.rollouts.packing import Sample, pack_samples, truncate
from asyncrl.rollouts.trajectory import episode_fields, episode_metrics
from asyncrl.transport.rollouts import write_rollouts
from asyncrl.utils.atomic import write_text_atomic
from asyncrl.workers.scoring import Scorer

log = logging.getLogger("asyncrl.orchestrator")


class BatchWriter:
    """Packs, writes and logs batches; the counters of every collaborator are read (and reset) once per
    batch."""

    def __init__(
        self,
        cfg: Config,
        run: RunDir,
        envs: dict[str, Environment],
        pad_id: int,
        monitor,
        counters: tuple[PromptSampler, Scorer, InferencePool, LoopMonitor],
        relay: PolicyRelay,
    ):
        self.cfg, self.oc, self.run, self.envs = cfg, cfg.orchestrator, run, envs
        self.pad_id, self.monitor = pad_id, monitor
        self.sampler, self.scorer, self.pool, self.loop_monitor = counters
        self.relay = relay
        self.drop_counts: Counter = Counter()  # groups dropped before packing, by reason (see select)
        self.truncation_warned = -(10**9)  # the step of the last warning that most samples were truncated
        self.failed_steps = 0  # steps in a row in which every reward failed (see check_rewards)
        # the top-k / top-p / min-p each sample records, for the trainer to score it under (none: the full
        # softmax)
        oc, scored_truncated = self.oc, truncates(cfg) and cfg.trainer.loss.truncated_logprobs
        self.sampled_under: dict[str, Any] = {}
        if scored_truncated:
            self.sampled_under = {"top_k": oc.top_k, "top_p": oc.top_p, "min_p": oc.min_p}

    def select(self, groups: list[Group]) -> tuple[list[Group], int]:
        """The groups worth training on and how many were dropped (no learning signal, or the difficulty
        filter's; each reason counted in ``self.drop_counts`` until the next logged step)."""
        kept = []
        for g in groups:
            reason = drop_reason(g.rewards, g.advantages, self.oc)
            if reason is None:
                kept.append(g)
            else:
                self.drop_counts[reason] += 1
        return kept, len(groups) - len(kept)

    async def write(
        self,
        step: int,
        groups: list[Group],
        gen_s: float,
        timing: dict[str, float],
        meta: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        dropped_before: int = 0,
    ) -> None:
        """Pack ``groups`` (zero-advantage groups dropped) into ``rollouts/step_<step>`` with the policy
        versions of their tokens, write their samples and log the step. ``gen_s``: the seconds the batch took
        to generate (the throughput's denominator); ``meta``/``metrics``: the schedule's own extras;
        ``dropped_before``: zero-advantage groups the schedule already dropped (counted with these).

        Packing and writing run in a worker thread: a batch of thousands of samples takes the CPU for a good
        part of a second, and on the event loop it would hold back every request in flight (continuous)."""
        kept, dropped = self.select(groups)
        dropped += dropped_before
        truncated, num_mbs = await asyncio.to_thread(
            self._pack_and_write, step, groups, kept, dropped, meta or {}
        )
        self.log_step(step, groups, gen_s, dropped, truncated, num_mbs, {**timing, **(metrics or {})})
        total = sum(len(r.branches) for g in groups for r in g.rollouts)
        if 2 * truncated > total and step - self.truncation_warned >= 50:  # every 50 steps at most
            self.truncation_warned = step
            log.warning(
                f"step {step}: {truncated} of {total} samples cut at "
                f"seq_len={self.cfg.seq_len}: raise seq_len "
                "or lower orchestrator.max_tokens"
            )

    def _samples(self, kept: list[Group]) -> tuple[list[Sample], int]:
        """Every branch of the kept groups as a sample cut to ``seq_len``;
        ``(samples, how many were cut)``."""
        samples, truncated = [], 0
        for g in kept:
            for r, a in zip(g.rollouts, g.advantages, strict=True):
                for b in r.branches:  # one for a single-turn completion; a multi-turn episode may fork
                    meta_s = {"env": g.env, "reward": r.reward}
                    sample = Sample(
                        b.prompt_ids,
                        b.completion_ids,
                        b.completion_logprobs,
                        a,
                        self.oc.temperature,
                        meta_s,
                        b.completion_mask,
                        b.teacher_logprobs,
                        routed_experts=b.routed_experts,
                        **self.sampled_under,
                    )
                    s = truncate(sample, self.cfg.seq_len)
                    truncated += s is None or s.meta.get("truncated", False)
                    if s is not None:
                        samples.append(s)
        return samples, truncated

    def _pack_and_write(
        self, step: int, groups: list[Group], kept: list[Group], dropped: int, meta: dict[str, Any]
    ) -> tuple[int, int]:
        """Write ``rollouts/step_<step>`` (and the samples file); ``(samples truncated, micro-batches)``."""
        samples, truncated = self._samples(kept)
        mbs = pack_samples(
            samples,
            self.cfg.seq_len,
            self.pad_id,
            self.cfg.trainer.micro_batch_rows,
            # one share per trainer rank, on every node: a rank with one micro-batch fewer than another would
            # wait in a collective that the other never joins; the ranks that split one row's sequence
            # (context parallelism) share their micro-batches
            multiple_of=data_parallel_ranks(self.cfg.trainer.fabric),
            one_per_row=self.cfg.trainer.fabric.context_parallel > 1,
        )
        versions = sorted({v for g in kept for v in g.versions}) or [
            min((g.min_version for g in groups), default=0)
        ]
        write_rollouts(
            self.run.rollout_step(step),
            mbs,
            {
                "step": step,
                "policy_versions": versions,
                "num_samples": len(samples),
                "num_groups": len(groups),
                "dropped_groups": dropped,
                "loss_tokens": int(sum(int(mb["loss_mask"].sum()) for mb in mbs)),
                **meta,
            },
        )
        if self.oc.save_samples:
            self.save_samples(step, groups)
        return truncated, len(mbs)

    def save_samples(self, step: int, groups: list[Group]) -> None:
        lines = []
        for g in groups:
            prompt = self.prompt_text(g)
            for r, a in zip(g.rollouts, g.advantages, strict=True):
                lines.append(
                    json.dumps(
                        {
                            "step": step,
                            "env": g.env,
                            "id": g.example.get("id"),
                            "prompt": prompt,
                            "completion": r.text,
                            "reward": r.reward,
                            "advantage": a,
                            "finish_reason": r.finish_reason,
                            "policy_version": g.min_version,
                            "policy_versions": sorted(g.versions),
                            "completion_tokens": r.completion_tokens,
                            **episode_fields(r),
                        }
                    )
                )
        write_text_atomic(self.run.samples_step(step), "\n".join(lines) + "\n")

    def take_filter_counts(self) -> dict[str, float]:
        """``rollout/filtered_<reason>`` since the last step (only with the difficulty filter on: the metrics
        of a run without it have no such keys)."""
        counts, self.drop_counts = self.drop_counts, Counter()
        if not self.oc.difficulty.enabled:
            return {}
        return {f"rollout/filtered_{r}": counts[r] for r in FILTER_REASONS}

    def env_metrics(self, groups: list[Group]) -> dict[str, float]:
        """Each environment's mean reward (in a mixture), and its own reward functions and metrics
        (verifiers' ``@vf.reward``/``@vf.metric``)."""
        metrics: dict[str, float] = {}
        if len(self.envs) > 1:
            for name in self.envs:
                rs = [r for g in groups if g.env == name for r in g.rewards]
                if rs:
                    metrics[f"rollout/{name}/reward_mean"] = mean(rs)
        for name in self.envs:
            rollouts = [r for g in groups if g.env == name for r in g.rollouts]
            metrics.update({f"rollout/{name}/{k}": v for k, v in episode_metrics(rollouts).items()})
        return metrics

    def log_step(self, step, groups, gen_s, dropped, truncated, num_mbs, extra: dict[str, float]) -> None:
        version = min((g.min_version for g in groups), default=self.relay.version)
        rewards = [r for g in groups for r in g.rewards]
        lengths = [r.completion_tokens for g in groups for r in g.rollouts]
        tokens = sum(lengths)
        reward_mean = mean(rewards)
        metrics = {
            "rollout/reward_mean": reward_mean,
            "rollout/reward_std": mean([(r - reward_mean) ** 2 for r in rewards]) ** 0.5,
            "rollout/completion_len_mean": tokens / len(lengths),
            "rollout/completion_tokens": tokens,
            "rollout/dropped_groups": dropped,
            "rollout/truncated": truncated,
            "rollout/micro_batches": num_mbs,
            "rollout/throughput_tok_s": tokens / max(gen_s, 1e-9),
            "async/staleness": step - version,
            "async/policy_version": version,
            **staleness(step, groups),
            **extra,
            **self.take_filter_counts(),
            **self.sampler.take_curriculum_counts(),
            **self.check_rewards(step, self.scorer.take_counts(), len(rewards)),
            "time/score_s": self.scorer.take_seconds(),
            **self.scorer.runner.take_stats(),
            **self.pool.take_counts(),
            **self.loop_monitor.take(),
        }
        if len(self.pool.urls) > 1:
            metrics.update({f"inference/server{i}_requests": n for i, n in enumerate(self.pool.served)})
        metrics.update(self.env_metrics(groups))
        self.monitor.log(metrics, step)
        want_samples, want_dist = extras_due(self.cfg.monitor, step)
        if want_samples or want_dist:
            samples, dists = rollout_extras(
                step,
                groups,
                self.prompt_text,
                self.cfg.monitor.wandb.log_extras.max_samples,
                want_samples,
                want_dist,
            )
            self.monitor.log_extras(step, samples, dists)
        log.info(f"step {step}: reward {reward_mean:.3f}, policy {version}, {tokens} tokens in {gen_s:.2f}s")

    def check_rewards(self, step: int, counts: dict[str, int], samples: int) -> dict[str, int]:
        """``counts`` (the scorer's failures of this step) back, once checked: when every one of the step's
        ``samples`` failed its reward (raised, timed out, lost its episode)
        ``orchestrator.max_failed_reward_steps`` steps in a row, the run stops. Those zeros carry no signal;
        training on them would look like a policy that stopped learning, and a filter that drops their groups
        would leave the trainer waiting."""
        failed = sum(counts.values())
        self.failed_steps = self.failed_steps + 1 if samples and failed >= samples else 0
        limit = self.oc.max_failed_reward_steps
        if limit and self.failed_steps >= limit:
            raise RuntimeError(
                f"step {step}: every reward failed in the last {self.failed_steps} steps ({counts}): the "
                "environment's reward is broken, not the policy; the warnings above name each failure. Fix "
                "the reward (env.<name>), then resume (ckpt.resume=latest); "
                "orchestrator.max_failed_reward_steps sets how many steps to allow"
            )
        return counts

    def prompt_text(self, g: Group) -> str:
        """The last message of the prompt ``g`` was sampled from (what the samples file and table show)."""
        return self.envs[g.env].prompt(g.example)[-1]["content"]
