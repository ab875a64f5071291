"""``asyncrl orchestrate``: the data plane of an RL run (asyncio, CPU).

Per step ``n``: make sure the sidecars serve an allowed policy (:mod:`asyncrl.orchestrator.policy`,
relaying ``weights/step_v`` through ``/update_weights``), draw ``prompts_per_step`` prompts, request
``group_size`` completions each, score them, compute group-relative advantages, drop zero-advantage
groups, pack into micro-batches and write ``rollouts/step_n`` atomically with the policy version that
produced it. With ``async_level >= 1`` this runs while the trainer is still on step ``n - 1``: that
overlap is where asynchronous RL gets its speed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.checkpoint import is_checkpoint_step, resolve_resume
from asyncrl.config import Config
from asyncrl.envs.rollout import episode_metrics
from asyncrl.evals.metrics import mean
from asyncrl.paths import RunDir, list_steps
from asyncrl.utils.atomic import atomic_dir, write_text_atomic
from asyncrl.utils.process import exit_wrapper, setup_logging

log = logging.getLogger("asyncrl.orchestrator")


def request_seed(seed: int, step: int, slot: int) -> int:
    """The sampling seed of prompt ``slot`` of ``step`` (non-negative, 63 bits): runs with one seed replay
    the same draws. Eval uses ``step=-1``, a stream no training step uses."""
    return ((seed * 1_000_003 + step) * 10_007 + slot) % (2**63)


@dataclass
class Group:
    """``group_size`` episodes of one prompt (:class:`~asyncrl.envs.rollout.Rollout`, from any environment)."""

    env: str
    example: dict[str, Any]
    rollouts: list  # Rollout
    advantages: list[float]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]


def rollout_context(cfg: Config, pool, scorer, temperature: float | None = None):
    """What the environments run episodes with: the sidecars, the reward guard, the sampling settings
    (``temperature``: the orchestrator's unless given) and the tokenizer verifiers' renderer is built on."""
    from asyncrl.envs.rollout import RolloutContext, Sampling

    oc = cfg.orchestrator
    temp = oc.temperature if temperature is None else temperature
    sampling = Sampling(temp, oc.top_p if temp > 0 else 1.0, oc.max_tokens)
    return RolloutContext(pool, scorer, sampling, cfg.model.name, cfg.model.tokenizer or cfg.model.name)


class Orchestrator:
    def __init__(self, cfg: Config):
        from asyncrl.config.compose import to_dict, to_yaml
        from asyncrl.envs import PromptSampler, build_envs
        from asyncrl.models import load_tokenizer
        from asyncrl.monitor import build_monitor
        from asyncrl.orchestrator.client import InferencePool
        from asyncrl.orchestrator.scoring import Scorer

        self.cfg, self.oc = cfg, cfg.orchestrator
        self.run = RunDir(cfg.run_dir).create()
        (self.run.configs / "orchestrator.yaml").write_text(to_yaml(cfg))
        self.resume = resolve_resume(cfg, self.run)
        if not cfg.inference.urls:
            raise ValueError(
                "inference.urls is empty: start a sidecar (`asyncrl serve`) and pass its URL, "
                "or use `asyncrl rl`, which does both"
            )
        self.pool = InferencePool(
            cfg.inference.urls,
            cfg.model.name,
            self.oc.request_timeout_s,
            self.oc.max_concurrency,
            cfg.inference.admin_token,
            self.oc.extra_body,
        )
        self.envs = build_envs(cfg.env, cfg.data_dir)
        self.sampler = PromptSampler(self.envs, {n: s.weight for n, s in cfg.env.items()}, "train", cfg.seed)
        self.pad_id = load_tokenizer(cfg.model).pad_token_id
        self.scorer = Scorer(self.oc.reward_workers, self.oc.reward_timeout_s)
        self.rollout_ctx = rollout_context(cfg, self.pool, self.scorer)
        self.monitor = build_monitor(
            cfg.monitor,
            self.run.metrics_file("orchestrator"),
            "orchestrator",
            config=to_dict(cfg),
            resume_step=self.resume,
        )
        self.version = 0
        self.truncation_warned = -(10**9)  # the step of the last warning that most samples were truncated
        self.nccl_group: asyncio.Task | None = None  # joining the trainer's NCCL group (weights.transport=nccl)

    # -- policy -------------------------------------------------------------------------------------
    async def ensure_policy(self, step: int) -> tuple[int, float, float]:
        """Wait for an allowed policy and load it on the sidecars: ``(version, wait_s, update_s)``."""
        from asyncrl.orchestrator.policy import choose_policy

        start = time.monotonic()
        while (
            v := choose_policy(step, self.cfg.async_level, self.cfg.strict_async, list_steps(self.run.weights))
        ) is None:
            if time.monotonic() - start > self.oc.wait_timeout_s:
                raise TimeoutError(
                    f"step {step}: no allowed policy after {self.oc.wait_timeout_s:.0f}s "
                    f"(async_level={self.cfg.async_level}); is the trainer running?"
                )
            await asyncio.sleep(self.oc.weights_poll_s)
        waited = time.monotonic() - start
        update_s = 0.0
        if v != self.version:
            # policy 0 is the starting model: reloadable only when model.name is a local directory
            path = self.run.weights_step(v) if v > 0 else Path(self.cfg.model.name)
            if not path.is_dir():
                raise RuntimeError(
                    f"cannot load policy {v} on the sidecars: {path} is not a directory "
                    "(a hub model is only policy 0 as loaded at sidecar start)"
                )
            if self.nccl_group is not None:
                await self.nccl_group  # a broadcast needs the group; raises if joining failed
            update_s = await self.pool.update_weights(str(path.resolve()), v)
            self.version = v
        return v, waited, update_s

    # -- rollouts -----------------------------------------------------------------------------------
    async def rollout_group(self, step: int, slot: int, draw) -> Group:
        from asyncrl.orchestrator.advantages import compute_advantages

        env = self.envs[draw.env]
        seed = request_seed(self.cfg.seed, step, slot)
        rollouts = await env.rollouts(self.rollout_ctx, draw.example, self.oc.group_size, seed)
        advantages = compute_advantages([r.reward for r in rollouts], self.oc.std_normalize)
        return Group(draw.env, draw.example, rollouts, advantages)

    async def step(self, step: int) -> None:
        from asyncrl.orchestrator.advantages import is_zero_advantage
        from asyncrl.orchestrator.packing import Sample, pack_samples, truncate
        from asyncrl.transport.rollouts import write_rollouts

        version, waited, update_s = await self.ensure_policy(step)
        draws = [self.sampler.draw() for _ in range(self.oc.prompts_per_step)]
        t0 = time.monotonic()
        groups = await asyncio.gather(*(self.rollout_group(step, i, d) for i, d in enumerate(draws)))
        gen_s = time.monotonic() - t0

        samples, dropped, truncated = [], 0, 0
        for g in groups:
            if self.oc.drop_zero_advantage and is_zero_advantage(g.advantages):
                dropped += 1
                continue
            for r, a in zip(g.rollouts, g.advantages, strict=True):
                for b in r.branches:  # one for a single-turn completion; a multi-turn episode may fork
                    meta = {"env": g.env, "reward": r.reward}
                    sample = Sample(
                        b.prompt_ids,
                        b.completion_ids,
                        b.completion_logprobs,
                        a,
                        self.oc.temperature,
                        meta,
                        b.completion_mask,
                    )
                    s = truncate(sample, self.cfg.seq_len)
                    truncated += s is None or s.meta.get("truncated", False)
                    if s is not None:
                        samples.append(s)
        mbs = pack_samples(
            samples,
            self.cfg.seq_len,
            self.pad_id,
            self.cfg.trainer.micro_batch_rows,
            multiple_of=self.cfg.trainer.fabric.devices,
        )
        write_rollouts(
            self.run.rollout_step(step),
            mbs,
            {
                "step": step,
                "policy_versions": [version],
                "num_samples": len(samples),
                "num_groups": len(groups),
                "dropped_groups": dropped,
                "loss_tokens": int(sum(int(mb["loss_mask"].sum()) for mb in mbs)),
            },
        )
        if self.oc.save_samples:
            self.save_samples(step, groups, version)
        self.log_step(step, groups, version, gen_s, waited, update_s, dropped, truncated, len(mbs))
        total = sum(len(r.branches) for g in groups for r in g.rollouts)
        if 2 * truncated > total and step - self.truncation_warned >= 50:  # every 50 steps at most
            self.truncation_warned = step
            log.warning(
                f"step {step}: {truncated} of {total} samples cut at seq_len={self.cfg.seq_len}: raise seq_len "
                "or lower orchestrator.max_tokens"
            )

    def save_samples(self, step: int, groups: list[Group], version: int) -> None:
        lines = []
        for g in groups:
            prompt = self.envs[g.env].prompt(g.example)[-1]["content"]
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
                            "policy_version": version,
                            "completion_tokens": r.completion_tokens,
                            **({"turns": r.info["turns"]} if "turns" in r.info else {}),
                            **({"metrics": r.info["metrics"]} if r.info.get("metrics") else {}),
                        }
                    )
                )
        write_text_atomic(self.run.samples_step(step), "\n".join(lines) + "\n")

    def log_step(self, step, groups, version, gen_s, waited, update_s, dropped, truncated, num_mbs) -> None:
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
            "time/generate_s": gen_s,
            "time/wait_policy_s": waited,
            "time/update_weights_s": update_s,
            **self.scorer.take_counts(),
        }
        if len(self.pool.urls) > 1:
            metrics.update({f"inference/server{i}_requests": n for i, n in enumerate(self.pool.served)})
        if len(self.envs) > 1:
            for name in self.envs:
                rs = [r for g in groups if g.env == name for r in g.rewards]
                if rs:
                    metrics[f"rollout/{name}/reward_mean"] = mean(rs)
        for name in self.envs:  # an environment's own reward functions and metrics (verifiers' @vf.reward/metric)
            rollouts = [r for g in groups if g.env == name for r in g.rollouts]
            metrics.update({f"rollout/{name}/{k}": v for k, v in episode_metrics(rollouts).items()})
        self.monitor.log(metrics, step)
        log.info(f"step {step}: reward {reward_mean:.3f}, policy {version}, {tokens} tokens in {gen_s:.2f}s")

    # -- checkpoints ------------------------------------------------------------------------------------
    def save_checkpoint(self, done: int) -> None:
        with atomic_dir(self.run.checkpoint(done, "orchestrator"), digest=True) as tmp:
            (tmp / "state.json").write_text(json.dumps({"step": done, "sampler": self.sampler.state_dict()}))

    def load_checkpoint(self, done: int) -> None:
        state = json.loads((self.run.checkpoint(done, "orchestrator") / "state.json").read_text())
        self.sampler.load_state_dict(state["sampler"])

    async def run_loop(self) -> None:
        start = 0
        if self.resume is not None:
            self.load_checkpoint(self.resume)
            start = self.resume
            log.info(f"resuming at step {start}")
        await self.pool.wait_healthy(self.cfg.inference.startup_timeout_s)
        versions = await self.pool.versions()
        self.version = versions[0] if len(set(versions)) == 1 else -1  # -1: servers disagree, reload all
        if self.cfg.weights.transport == "nccl":
            from asyncrl.transport.nccl import inference_workers

            # joins once the trainer opens the group; steps on policy 0 need no weights, so they go on meanwhile
            w = self.cfg.weights
            self.nccl_group = asyncio.create_task(
                self.pool.init_weight_transfer(
                    w.nccl_host, w.nccl_port, inference_workers(self.cfg) // len(self.pool.urls)
                )
            )
        try:
            for step in range(start, self.cfg.max_steps):
                await self.step(step)
                if is_checkpoint_step(step + 1, self.cfg.ckpt.interval, self.cfg.max_steps):
                    self.save_checkpoint(step + 1)
        finally:
            if self.nccl_group is not None and not self.nccl_group.done():
                self.nccl_group.cancel()
            for env in self.envs.values():
                await env.close()
            self.monitor.close()
            await self.pool.close()


@exit_wrapper("orchestrator")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    setup_logging("orchestrator")
    asyncio.run(Orchestrator(cfg).run_loop())
