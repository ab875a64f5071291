"""``asyncrl train``: the RL trainer (Lightning Fabric; one device on CPU, FSDP on GPUs).

Step ``n`` waits for ``rollouts/step_n``, checks the async bound on the policy versions recorded there,
recomputes logprobs on the packed micro-batches, applies the RL loss (:mod:`asyncrl.trainer.loss`)
normalised over the step's loss tokens, takes one optimizer step and publishes ``weights/step_{n+1}``.
Checkpoints (model, optimizer, scheduler, progress, RNG) follow ``ckpt.interval``; the final policy is
also written to ``<run_dir>/model``.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from asyncrl.checkpoint import (
    complete_checkpoints,
    is_checkpoint_step,
    protected_weights,
    prune_checkpoints,
    resolve_resume,
)
from asyncrl.config import Config
from asyncrl.numerics import configure_torch
from asyncrl.paths import RunDir, stable
from asyncrl.utils.atomic import write_text_atomic
from asyncrl.utils.process import exit_wrapper, setup_logging

log = logging.getLogger("asyncrl.trainer")


@exit_wrapper("trainer")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    setup_logging("trainer")
    configure_torch(cfg.numerics, cfg.trainer.fabric.num_threads)
    if cfg.numerics == "bitwise":  # vLLM's batch-invariant mode, before CUDA is initialised
        from asyncrl.models import bitwise

        bitwise.enable()
    from asyncrl.config.compose import to_yaml
    from asyncrl.utils.seed import seed_everything

    run = RunDir(cfg.run_dir).create()
    resume = resolve_resume(cfg, run)
    cfg_yaml = to_yaml(cfg)
    # every rank writes it (the rank is known only once Fabric is up): atomically, so that ranks sharing the
    # run directory (one machine, or nodes on a shared filesystem) never leave it torn
    write_text_atomic(run.configs / "trainer.yaml", cfg_yaml)
    seed_everything(cfg.seed, cfg.deterministic)
    train(cfg, run, resume, cfg_yaml, overrides)


def train(cfg: Config, run: RunDir, resume: int | None, cfg_yaml: str, overrides: list[str] | None = None) -> None:
    import torch

    from asyncrl.config.compose import to_dict
    from asyncrl.models import TORCH_DTYPES
    from asyncrl.monitor import build_monitor, extras_due
    from asyncrl.trainer.behavior import BehaviorPolicies
    from asyncrl.trainer.forward import micro_batch_to_device, packed_logprobs
    from asyncrl.trainer.loss import LossInputs, adapt_kl_beta, mismatch_kl_sum, rl_loss, sequence_ids
    from asyncrl.trainer.state import build_reference, build_train_state, export_final
    from asyncrl.trainer.step import step_over_micro_batches
    from asyncrl.transport.files import export_model
    from asyncrl.transport.nccl import NCCLSender, export_entries, sent_directly, write_manifest
    from asyncrl.transport.policy import batch_bound, check_bound
    from asyncrl.transport.rollouts import read_rollouts
    from asyncrl.transport.weights import prune
    from asyncrl.utils.atomic import wait_until

    tc = cfg.trainer
    log.info(f"build fabric, model {cfg.model.name}, optimizer")
    fabric, raw, tokenizer, state = build_train_state(
        cfg, tc.optim, tc.scheduler, cfg.max_steps, vllm_forward=cfg.numerics == "bitwise"
    )
    if fabric.global_rank == 0 and not run.meta_file.exists():
        # started on its own (docker compose, a cluster job), not by `asyncrl rl`, which writes these first:
        # the run directory must still say what produced it, before step 0
        from asyncrl.utils.meta import write_run_files

        write_run_files(run, cfg, overrides, started_by="asyncrl train")
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    if resume is not None:
        state.load(fabric, run.checkpoint(resume, "trainer"))
        log.info(f"resumed from checkpoint step {resume}")
    start = state.progress.get("step", 0)
    # the KL weight adapts step by step (trainer.kl.target_kl): a checkpoint keeps the current one
    kl_beta = float(state.progress.get("kl_beta", tc.kl.beta))
    # the reference of a LoRA run is the policy with its adapters switched off (no second copy)
    reference = build_reference(fabric, cfg) if tc.kl.beta > 0 and not cfg.model.lora.enabled else None
    kl_on = tc.kl.beta > 0
    sender = ipc = None
    if cfg.weights.transport == "nccl":
        log.info(f"opening the NCCL group at {cfg.weights.nccl_host}:{cfg.weights.nccl_port} (waits for the sidecars)")
        sender, serve_dtype = NCCLSender(cfg, fabric.global_rank), TORCH_DTYPES[cfg.model.dtype]
        entries = export_entries(raw, serve_dtype)
    elif cfg.weights.transport == "ipc":
        from asyncrl.transport.ipc import IPCSender

        # one process on the sidecar's GPU (config.root checks): the buffer the sidecar reads each policy from
        ipc = IPCSender(raw, TORCH_DTYPES[cfg.model.dtype], cfg.weights.reload)
    monitor = (
        build_monitor(cfg.monitor, run.metrics_file("trainer"), "trainer", config=to_dict(cfg), resume_step=resume)
        if fabric.global_rank == 0
        else None
    )

    ratios: list[torch.Tensor] | None = None  # the loss tokens' importance ratios, on steps that log distributions

    def loss_fn(logprobs: torch.Tensor, mb: dict[str, torch.Tensor]):
        if ratios is not None:
            with torch.no_grad():
                mask = mb["loss_mask"][:, 1:].bool()
                ratios.append(torch.exp(logprobs - mb["inference_logprobs"][:, 1:])[mask].float().cpu())
        ref_logprobs = None
        if reference is not None:
            with torch.no_grad(), fabric.autocast():
                ref_logprobs = packed_logprobs(reference, mb)
        elif kl_on:  # LoRA
            with torch.no_grad(), raw.disable_adapter():
                ref_logprobs = packed_logprobs(model, mb)
        inputs = LossInputs(
            logprobs,
            mb["inference_logprobs"][:, 1:],
            mb["advantages"][:, 1:],
            mb["loss_mask"][:, 1:],
            total_tokens,
            sequence_ids(mb["position_ids"])[:, 1:] if tc.loss.type == "gspo" else None,
            total_sequences,
            ref_logprobs,
            kl_beta,
            mb["teacher_logprobs"][:, 1:] if "teacher_logprobs" in mb else None,
            cfg.distill.weight,
        )
        return rl_loss(inputs, tc.loss, read_metrics=False)  # step_over_micro_batches reads them once a step

    bound, strict, knob = batch_bound(cfg)
    # trainer.behavior_kl: the policies that sampled the coming steps' rollouts, kept in memory (a resumed run
    # has none of those before its restart, and logs behavior_kl again from `bound` steps on)
    behavior = BehaviorPolicies(raw, bound, TORCH_DTYPES[cfg.model.dtype]) if tc.behavior_kl else None

    def behavior_kl(step: int, mbs: list[dict], versions: list[int]) -> float | None:
        """Sum of the k3 per loss token between the sidecar's logprobs and the sampling policy's here, or
        ``None`` when that policy is not at hand (samples of several policies, or from before a resume)."""
        if behavior is None or len(set(versions)) != 1 or versions[0] == step:
            return None  # at the live policy, the loss's own mismatch_kl is the behavior KL
        if versions[0] not in behavior.kept:
            return None
        total = 0.0
        with behavior.swapped(versions[0]), torch.no_grad():
            for mb in mbs:
                mb = micro_batch_to_device(mb, fabric.device)
                logprobs = packed_logprobs(model, mb)
                total += mismatch_kl_sum(logprobs, mb["inference_logprobs"][:, 1:], mb["loss_mask"][:, 1:])
        return total

    try:
        for step in range(start, cfg.max_steps):
            path = run.rollout_step(step)
            t0 = time.monotonic()
            wait_until(partial(stable, path), tc.wait_timeout_s, 0.01, f"rollouts of step {step} at {path}")
            waited = time.monotonic() - t0
            mbs, meta = read_rollouts(path, fabric.global_rank, fabric.world_size)
            check_bound(step, bound, strict, meta["policy_versions"], knob)
            total_tokens, total_sequences = meta["loss_tokens"], meta.get("num_samples", 0)
            t1 = time.monotonic()
            # W&B distributions (monitor.wandb.log_extras), from rank 0's share of the step's tokens
            entropies: list[torch.Tensor] | None = (
                [] if monitor is not None and extras_due(cfg.monitor, step)[1] else None
            )
            ratios = [] if entropies is not None else None
            behind = behavior_kl(step, mbs, meta["policy_versions"])
            if behavior is not None:
                behavior.snapshot(step)  # policy `step`, for the steps that train on its samples
            sums = step_over_micro_batches(
                fabric, model, optimizer, scheduler, mbs, loss_fn, tc.optim.max_grad_norm, entropies
            )
            if behavior is not None and (behind is not None or set(meta["policy_versions"]) == {step}):
                sums["behavior_kl"] = sums.get("mismatch_kl", 0.0) if behind is None else behind
            if fabric.world_size > 1:  # per-rank sums -> step totals; the gradient norm is already global
                sums = {
                    k: v if k == "grad_norm" else float(fabric.all_reduce(torch.tensor(v), reduce_op="sum"))
                    for k, v in sums.items()
                }
            compute_s = time.monotonic() - t1
            t2 = time.monotonic()
            if ipc is not None and sent_directly(step + 1, cfg):  # returns once the sidecar copied it
                ipc.send(raw, run.weights_step(step + 1), step + 1, tc.wait_timeout_s)
            elif sent_directly(step + 1, cfg):  # manifest first: the orchestrator's relay starts the receive
                if fabric.global_rank == 0:
                    write_manifest(run.weights_step(step + 1), entries, step + 1, cfg.weights.reload)
                assert sender is not None
                sender.send(raw, serve_dtype)  # returns once the sidecars have it
            else:
                export_model(fabric, raw, tokenizer, run.weights_step(step + 1), cfg.model.dtype)
            publish_s = time.monotonic() - t2
            n = max(sums.get("tokens", 0.0), 1.0)
            kl_metrics: dict[str, float] = {}
            if "distill_kl" in sums:  # online distillation: the reverse KL to the teacher, per loss token
                kl_metrics["train/distill_kl"] = sums["distill_kl"] / n
            if "behavior_kl" in sums:
                kl_metrics["train/behavior_kl"] = sums["behavior_kl"] / n
            if kl_on:  # the weight this step used, then the next step's (same on every rank)
                kl_metrics.update({"train/kl_ref": sums.get("kl_ref", 0.0) / n, "train/kl_beta": kl_beta})
                kl_beta = adapt_kl_beta(kl_beta, kl_metrics["train/kl_ref"], tc.kl.target_kl, tc.kl.adapt_rate)
            state.progress = {"step": step + 1, **({"kl_beta": kl_beta} if kl_on else {})}
            if monitor is not None:  # rank 0
                tokens = sum(int(mb["input_ids"].numel()) for mb in mbs) * fabric.world_size
                if fabric.device.type == "cuda":  # what LoRA against full fine-tuning is measured by
                    kl_metrics["train/peak_mem_gib"] = torch.cuda.max_memory_allocated(fabric.device) / 2**30
                monitor.log(
                    {
                        **kl_metrics,
                        "train/loss": sums["loss"],
                        "train/mismatch_kl": sums.get("mismatch_kl", 0.0) / n,
                        "train/ratio_mean": sums.get("ratio", 0.0) / n,
                        "train/masked_frac": (sums.get("masked_low", 0.0) + sums.get("masked_high", 0.0)) / n,
                        "train/grad_norm": sums["grad_norm"],
                        "train/lr": scheduler.get_last_lr()[0],
                        "train/loss_tokens": total_tokens,
                        "train/tokens_per_s": tokens / max(compute_s, 1e-9),
                        "async/staleness": step - min(meta["policy_versions"]),
                        "time/train_s": compute_s,
                        "time/publish_s": publish_s,
                        "time/wait_rollouts_s": waited,
                    },
                    step,
                )
                if entropies is not None and ratios is not None:
                    monitor.log_extras(
                        step,
                        distributions={
                            "train/entropy_hist": torch.cat(entropies).tolist() if entropies else [],
                            "train/ratio_hist": torch.cat(ratios).tolist() if ratios else [],
                        },
                    )
                log.info(
                    f"step {step}: loss {sums['loss']:.4f}, mismatch_kl {sums.get('mismatch_kl', 0.0) / n:.2e}, "
                    f"{compute_s:.2f}s"
                )
            # after the step's metrics row: a checkpoint N must find the rows of steps < N on disk, or a run
            # killed between the two would resume with row N-1 missing
            if is_checkpoint_step(step + 1, cfg.ckpt.interval, cfg.max_steps):
                state.save(fabric, run.checkpoint(step + 1, "trainer"), cfg_yaml)
            if fabric.global_rank == 0:
                kept = complete_checkpoints(run)[-cfg.ckpt.keep_last :]
                prune_checkpoints(run, cfg.ckpt.keep_last)
                prune(run.weights, tc.keep_weights, protected_weights(kept + [step + 1], cfg.async_level))
                prune(run.rollouts, tc.keep_weights)
        export_final(fabric, raw, tokenizer, cfg, run.model)  # collective: every rank takes part
    finally:
        if monitor:
            monitor.close()
