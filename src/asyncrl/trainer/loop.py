"""The RL trainer's loop (``asyncrl train``, entered from :mod:`asyncrl.trainer.train` once the process's
torch environment is set).

Step ``n`` waits for ``rollouts/step_n``, checks the async bound on the policy versions recorded there,
recomputes logprobs on the packed micro-batches, applies the RL loss
(:class:`asyncrl.trainer.objective.RLObjective`) normalised over the step's loss tokens, takes one optimizer
step and publishes ``weights/step_{n+1}`` through the transport chosen at start
(:meth:`asyncrl.transport.base.Transport.publisher`). Checkpoints (model, optimizer, scheduler, progress,
RNG) follow ``ckpt.interval``; the final policy is also written to ``<run_dir>/model``.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from asyncrl.checkpoint import complete_checkpoints, is_checkpoint_step, protected_weights, prune_checkpoints
from asyncrl.config import Config
from asyncrl.config.compose import to_dict
from asyncrl.config.layout import data_parallel_ranks
from asyncrl.models.hf import TORCH_DTYPES
from asyncrl.monitor import Monitor, build_monitor, extras_due
from asyncrl.paths import RunDir, stable
from asyncrl.trainer.behavior import BehaviorPolicies
from asyncrl.trainer.context import ContextParallel
from asyncrl.trainer.objective import RLObjective
from asyncrl.trainer.perf import batch_lengths, gpu_name, mfu_metrics, step_flops
from asyncrl.trainer.profile import maybe_profiled
from asyncrl.trainer.state import TrainState, build_train_state, export_final
from asyncrl.trainer.step import step_over_micro_batches
from asyncrl.transport.base import transport_of
from asyncrl.transport.policy import batch_bound, check_bound
from asyncrl.transport.rollouts import read_rollouts
from asyncrl.transport.weights import prune
from asyncrl.utils.atomic import wait_until
from asyncrl.utils.meta import write_run_files

log = logging.getLogger("asyncrl.trainer")


def train(
    cfg: Config, run: RunDir, resume: int | None, cfg_yaml: str, overrides: list[str] | None = None
) -> None:
    tc = cfg.trainer
    log.info(f"build fabric, model {cfg.model.name}, optimizer")
    fabric, raw, tokenizer, state = build_train_state(
        cfg, tc.optim, tc.scheduler, cfg.max_steps, vllm_forward=cfg.numerics == "bitwise"
    )
    if fabric.global_rank == 0 and not run.meta_file.exists():
        # started on its own (docker compose, a cluster job), not by `asyncrl rl`, which writes these first:
        # the run directory must still say what produced it, before step 0
        write_run_files(run, cfg, overrides, started_by="asyncrl train")
    if resume is not None:
        state.load(fabric, run.checkpoint(resume, "trainer"))
        log.info(f"resumed from checkpoint step {resume}")
    objective = RLObjective(cfg, fabric, state.model, raw, float(state.progress.get("kl_beta", tc.kl.beta)))
    publisher = transport_of(cfg).publisher(cfg, fabric, raw, tokenizer)
    cp = ContextParallel(tc.fabric.context_parallel, fabric)
    monitor = (
        build_monitor(
            cfg.monitor, run.metrics_file("trainer"), "trainer", config=to_dict(cfg), resume_step=resume
        )
        if fabric.global_rank == 0
        else None
    )
    bound, strict, knob = batch_bound(cfg)
    # trainer.behavior_kl: the policies that sampled the coming steps' rollouts, kept in memory (a resumed
    # run has none of those before its restart, and logs behavior_kl again from `bound` steps on)
    behavior = BehaviorPolicies(raw, bound, TORCH_DTYPES[cfg.model.dtype]) if tc.behavior_kl else None
    try:
        for step in range(state.progress.get("step", 0), cfg.max_steps):
            path = run.rollout_step(step)
            t0 = time.monotonic()
            wait_until(partial(stable, path), tc.wait_timeout_s, 0.01, f"rollouts of step {step} at {path}")
            waited = time.monotonic() - t0
            mbs, meta = read_rollouts(path, fabric.global_rank // cp.size, data_parallel_ranks(tc.fabric))
            check_bound(step, bound, strict, meta["policy_versions"], knob)
            t1 = time.monotonic()
            # W&B distributions (monitor.wandb.log_extras), from rank 0's share of the step's tokens
            entropies: list[torch.Tensor] | None = (
                [] if monitor is not None and extras_due(cfg.monitor, step)[1] else None
            )
            objective.start_step(meta, record_ratios=entropies is not None)
            with maybe_profiled(
                tc.profile_step, step, run.profile, fabric.global_rank, fabric.device.type == "cuda"
            ):
                sums = train_step(
                    fabric, state, objective, behavior=behavior, max_grad_norm=tc.optim.max_grad_norm,
                    step=step, mbs=mbs, meta=meta, entropies=entropies, cp=cp,
                )  # fmt: skip
            compute_s = time.monotonic() - t1
            flops = all_flops(fabric, raw.config, mbs, cp.size)
            t2 = time.monotonic()
            publisher.publish(step + 1, run.weights_step(step + 1))
            times = {
                "time/train_s": compute_s,
                "time/publish_s": time.monotonic() - t2,
                "time/wait_rollouts_s": waited,
            }
            kl_metrics = objective.finish_step(sums)
            state.progress = objective.progress(step + 1)
            if monitor is not None:  # rank 0
                log_step(
                    monitor, fabric, state.scheduler, step, sums, kl_metrics=kl_metrics, times=times,
                    mbs=mbs, meta=meta, context_parallel=cp.size, flops=flops,
                )  # fmt: skip
                log_distributions(monitor, step, entropies, objective.ratios)
            # after the step's metrics row: a checkpoint N must find the rows of steps < N on disk, or a run
            # killed between the two would resume with row N-1 missing
            if is_checkpoint_step(step + 1, cfg.ckpt.interval, cfg.max_steps):
                state.save(fabric, run.checkpoint(step + 1, "trainer"), cfg_yaml)
            if fabric.global_rank == 0:
                prune_step(cfg, run, step + 1)
        export_final(fabric, raw, tokenizer, cfg, run.model)  # collective: every rank takes part
    finally:
        if monitor:
            monitor.close()


def train_step(
    fabric,
    state: TrainState,
    objective: RLObjective,
    *,
    behavior: BehaviorPolicies | None,
    max_grad_norm: float,
    step: int,
    mbs: list[dict[str, torch.Tensor]],
    meta: dict,
    entropies: list[torch.Tensor] | None,
    cp: ContextParallel | None = None,
) -> dict[str, float]:
    """One optimizer step on this rank's micro-batches; the step's metric sums over all ranks
    (``behavior_kl`` too, under ``trainer.behavior_kl``: measured before the step, under the policy that
    sampled the batch)."""
    versions = meta["policy_versions"]
    behind = behavior.kl(state.model, fabric.device, step, mbs, versions) if behavior is not None else None
    if behavior is not None:
        behavior.snapshot(step)  # policy `step`, for the steps that train on its samples
    sums = step_over_micro_batches(
        fabric, state.model, state.optimizer, state.scheduler, mbs, objective.loss,
        max_grad_norm=max_grad_norm, entropy_out=entropies, cp=cp,
    )  # fmt: skip
    routing = getattr(state.model, "asyncrl_routing", None)
    if routing is not None:
        sums.update(routing.take())
    if behavior is not None and (behind is not None or set(versions) == {step}):
        sums["behavior_kl"] = sums.get("mismatch_kl", 0.0) if behind is None else behind
    if fabric.world_size > 1:  # per-rank sums -> step totals; the gradient norm is already global
        sums = {
            k: v if k == "grad_norm" else float(fabric.all_reduce(torch.tensor(v), reduce_op="sum"))
            for k, v in sums.items()
        }
    return sums


def log_step(
    monitor: Monitor,
    fabric,
    scheduler,
    step: int,
    sums: dict[str, float],
    *,
    kl_metrics: dict[str, float],
    times: dict[str, float],
    mbs: list[dict[str, torch.Tensor]],
    meta: dict,
    context_parallel: int = 1,
    flops: dict[str, float] | None = None,
) -> None:
    """The step's row of ``metrics/trainer.jsonl`` (rank 0), and its progress line. ``flops``: the step's,
    over every rank (:func:`all_flops`), for its MFU both ways on a GPU of known peak."""
    n = max(sums.get("tokens", 0.0), 1.0)
    compute_s = times["time/train_s"]
    # every data-parallel share holds as many micro-batches; the ranks of a context-parallel group share one
    tokens = sum(int(mb["input_ids"].numel()) for mb in mbs) * (fabric.world_size // context_parallel)
    if fabric.device.type == "cuda":  # what LoRA against full fine-tuning is measured by
        stats = torch.cuda.memory_stats(fabric.device)
        kl_metrics = {
            **kl_metrics,
            "train/peak_mem_gib": stats.get("allocated_bytes.all.peak", 0) / 2**30,
            # near a full GPU the caching allocator frees its cache and retries (a device sync each): the
            # step slows
            "train/alloc_retries": stats.get("num_alloc_retries", 0),
        }
    monitor.log(
        {
            **kl_metrics,
            "train/loss": sums["loss"],
            "train/mismatch_kl": sums.get("mismatch_kl", 0.0) / n,
            "train/ratio_mean": sums.get("ratio", 0.0) / n,
            "train/masked_frac": (sums.get("masked_low", 0.0) + sums.get("masked_high", 0.0)) / n,
            "train/grad_norm": sums["grad_norm"],
            "train/lr": scheduler.get_last_lr()[0],
            "train/loss_tokens": meta["loss_tokens"],
            "train/tokens_per_s": tokens / max(compute_s, 1e-9),
            **mfu_metrics("train", flops or {}, compute_s, gpu_name(fabric.device), fabric.world_size),
            "async/staleness": step - min(meta["policy_versions"]),
            **moe_metrics(sums),
            **times,
        },
        step,
    )
    log.info(
        f"step {step}: loss {sums['loss']:.4f}, mismatch_kl "
        f"{sums.get('mismatch_kl', 0.0) / n:.2e}, {compute_s:.2f}s"
    )


def all_flops(fabric, config, mbs: list[dict[str, torch.Tensor]], context_parallel: int) -> dict[str, float]:
    """The step's training FLOPs both ways (:func:`asyncrl.trainer.perf.step_flops`) over every rank's
    samples; the ranks of a context-parallel group hold the same ones. A collective: every rank calls it."""
    flops = step_flops(config, batch_lengths(mbs))
    if fabric.world_size == 1:
        return flops
    total = fabric.all_reduce(torch.tensor(list(flops.values()), dtype=torch.float64), reduce_op="sum")
    return {k: float(v) / context_parallel for k, v in zip(flops, total.tolist(), strict=True)}


def moe_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The share of the tokens with sampler routes whose experts (in any layer) differ from those routes: as
    the trainer used them (0 with trainer.router_replay), and as its router picks them."""
    if not sums.get("moe_tokens"):
        return {}
    n = sums["moe_tokens"]
    return {
        "train/moe_routes_differ": sums["moe_routes_differ"] / n,
        "train/moe_router_disagrees": sums["moe_router_disagrees"] / n,
    }


def log_distributions(
    monitor: Monitor, step: int, entropies: list[torch.Tensor] | None, ratios: list[torch.Tensor] | None
) -> None:
    """W&B's histograms of the loss tokens' entropies and importance ratios, on the steps that record
    them."""
    if entropies is None or ratios is None:
        return
    monitor.log_extras(
        step,
        distributions={
            "train/entropy_hist": torch.cat(entropies).tolist() if entropies else [],
            "train/ratio_hist": torch.cat(ratios).tolist() if ratios else [],
        },
    )


def prune_step(cfg: Config, run: RunDir, done: int) -> None:
    """Rank 0, after ``done`` steps: old checkpoints, and the weights and rollouts no checkpoint or reader
    needs."""
    kept = complete_checkpoints(run)[-cfg.ckpt.keep_last :]
    prune_checkpoints(run, cfg.ckpt.keep_last)
    prune(run.weights, cfg.trainer.keep_weights, protected_weights(kept + [done], cfg.async_level))
    prune(run.rollouts, cfg.trainer.keep_weights)
