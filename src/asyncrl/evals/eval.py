"""``asyncrl eval``: score a model on each environment's eval split.

Starts a sidecar for ``model.name`` (or uses ``eval.url``), then per environment scores one greedy
completion and ``eval.n`` completions sampled at ``orchestrator.temperature`` per prompt (seeded), and
writes ``<eval.out_dir>/metrics.json`` (mean rewards, pass@k) and ``samples.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from asyncrl.config import Config
from asyncrl.config.compose import to_dict, to_yaml
from asyncrl.envs import build_envs
from asyncrl.monitor import WandbMonitor, read_jsonl
from asyncrl.rollouts.client import InferencePool
from asyncrl.rollouts.context import request_seed, rollout_context
from asyncrl.rollouts.metrics import ks_for, mean, pass_at_k
from asyncrl.rollouts.trajectory import episode_fields, episode_metrics
from asyncrl.utils import forked
from asyncrl.utils.atomic import write_json_atomic, write_text_atomic
from asyncrl.utils.children import Proc, asyncrl_argv, spawn, stop, wait_healthy
from asyncrl.utils.process import exit_wrapper, free_port, setup_logging
from asyncrl.workers.pool import build_runner
from asyncrl.workers.scoring import Scorer

log = logging.getLogger("asyncrl.eval")


class _Progress:
    """About ten log lines per environment while its prompts are scored: an eval takes minutes."""

    def __init__(self, env: str, total: int):
        self.env, self.total, self.done, self.every = env, total, 0, max(1, total // 10)

    def tick(self) -> None:
        self.done += 1
        if self.done % self.every == 0 or self.done == self.total:
            log.info(f"env {self.env}: {self.done}/{self.total} prompts scored")


async def evaluate(cfg: Config, url: str, out: Path) -> dict:
    ec, oc = cfg.eval, cfg.orchestrator
    pool = InferencePool(
        [url], cfg.model.name, oc.request_timeout_s, oc.max_concurrency, cfg.inference.admin_token
    )
    scorer = Scorer(build_runner(oc, cfg.env, cfg.data_dir), oc.reward_timeout_s, oc.env_workers.retries)
    greedy, sampled = rollout_context(cfg, pool, scorer, temperature=0.0), rollout_context(cfg, pool, scorer)
    envs = build_envs(cfg.env, cfg.data_dir)
    metrics: dict[str, float] = {}
    samples: list[dict] = []
    try:
        await pool.wait_healthy(cfg.inference.startup_timeout_s)
        for name, env in envs.items():
            rows = env.load(ec.split)
            rows = rows[: ec.num_examples] if ec.num_examples else rows
            log.info(
                f"env {name}: {len(rows)} prompts x ({int(ec.greedy)} greedy + {ec.n} sampled) completions"
            )
            progress = _Progress(name, len(rows))

            async def one(i: int, ex: dict, env=env, progress=progress) -> dict[str, list]:
                """The example's rollouts by mode: the same episodes as training runs, greedy and/or sampled
                (seeded)."""
                runs = {"greedy": env.rollouts(greedy, ex, 1, None)} if ec.greedy else {}
                runs["sampled"] = env.rollouts(sampled, ex, ec.n, request_seed(cfg.seed, -1, i))
                results = await asyncio.gather(*runs.values())
                progress.tick()
                return dict(zip(runs, results, strict=True))

            per = await asyncio.gather(*(one(i, ex) for i, ex in enumerate(rows)))
            # samples in prompt order (gather keeps it), not completion order: the file is a DVC out and
            # must hash the same on a rerun
            for ex, by_mode in zip(rows, per, strict=True):
                prompt = env.prompt(ex)[-1]["content"]
                samples.extend(
                    {
                        "env": name,
                        "id": ex.get("id"),
                        "mode": mode,
                        "prompt": prompt,
                        "completion": r.text,
                        "reward": r.reward,
                        **episode_fields(r),
                    }
                    for mode, rollouts in by_mode.items()
                    for r in rollouts
                )
            sampled_rewards = [[r.reward for r in by_mode["sampled"]] for by_mode in per]
            if ec.greedy:
                metrics[f"{name}/greedy/reward_mean"] = mean(
                    [by_mode["greedy"][0].reward for by_mode in per]
                )
            metrics[f"{name}/sampled/reward_mean"] = mean([r for s in sampled_rewards for r in s])
            for k in ks_for(ec.n):
                metrics[f"{name}/sampled/pass@{k}"] = mean(
                    [pass_at_k(ec.n, sum(r >= ec.pass_threshold for r in s), k) for s in sampled_rewards]
                )
            for mode in ("greedy", "sampled"):  # the environment's own reward functions and metrics, if any
                done = [r for by_mode in per for r in by_mode.get(mode, [])]
                metrics.update({f"{name}/{mode}/{k}": v for k, v in episode_metrics(done).items()})
            metrics[f"{name}/num_examples"] = len(rows)
    finally:
        for env in envs.values():
            await env.close()
        await scorer.close()
        await pool.close()
    for mode in ("greedy", "sampled"):
        vals = [v for k, v in metrics.items() if k.endswith(f"/{mode}/reward_mean")]
        if vals:
            metrics[f"{mode}/reward_mean"] = mean(vals)
    metrics.update(scorer.take_counts())
    (out / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return metrics


def log_to_wandb(cfg: Config, out: Path, metrics: dict) -> None:
    """The eval's metrics (as ``eval/...``) and a table of its first samples, as a W&B run of job type
    ``eval`` in the training runs' project (``monitor.wandb``), its files under ``<eval.out_dir>/wandb``."""
    monitor = WandbMonitor(cfg.monitor, out, "eval", to_dict(cfg))
    try:
        monitor.log({f"eval/{k}": v for k, v in metrics.items()}, 0)
        if cfg.monitor.wandb.log_extras.samples:
            rows = read_jsonl(out / "samples.jsonl")[: cfg.monitor.wandb.log_extras.max_samples]
            monitor.log_extras(
                0,
                [{k: v if isinstance(v, (int, float, str)) else str(v) for k, v in r.items()} for r in rows],
            )
    finally:
        monitor.close()


def start_sidecar(cfg: Config, out: Path) -> Proc:
    """The eval's own sidecar, on ``<out>/config.yaml``. The built-in one starts as a fork of this process
    once it imported torch and transformers, as the launcher starts its own: a fresh interpreter would spend
    seconds of CPU importing them."""
    argv = asyncrl_argv("serve", out / "config.yaml", python=cfg.launcher.inference_python)
    fork = forked.forks(cfg)["inference"]
    if fork:
        forked.preload()
    return spawn("inference", argv, out / "inference.log", fork=fork)


@exit_wrapper("eval")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    setup_logging("eval")
    out = Path(cfg.eval.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sidecar = None
    url = cfg.eval.url
    if url is None:
        cfg.inference.port = cfg.inference.port or free_port(cfg.inference.host)
        url = f"http://{cfg.inference.host}:{cfg.inference.port}"
    write_text_atomic(out / "config.yaml", to_yaml(cfg))
    try:
        if cfg.eval.url is None:
            sidecar = start_sidecar(cfg, out)
            log.info(f"starting a sidecar for {cfg.model.name} at {url} (log: {out / 'inference.log'})")
            started = time.monotonic()
            wait_healthy(sidecar, url, cfg.inference.startup_timeout_s)
            log.info(f"sidecar ready in {time.monotonic() - started:.0f} s")
        metrics = asyncio.run(evaluate(cfg, url, out))
    finally:
        if sidecar is not None:
            stop([sidecar], cfg.launcher.shutdown_timeout_s)
    write_json_atomic(out / "metrics.json", {"model": cfg.model.name, **metrics})
    if cfg.monitor.wandb.enabled:
        log_to_wandb(cfg, out, metrics)
    width = max(len(k) for k in metrics)
    print(f"eval of {cfg.model.name} ({out / 'metrics.json'}):")
    for k, v in metrics.items():
        print(f"  {k:<{width}}  {v:.4f}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
