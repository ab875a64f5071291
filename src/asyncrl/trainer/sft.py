"""``asyncrl sft``: supervised warmup with the same Fabric machinery as the RL trainer.

Draws ``sft.batch_size`` examples per step from the environments' train splits (the same seeded
sampler as the orchestrator), renders each prompt + reference episode (``Environment.demonstration``: one
answer, or a multi-turn exchange with a tool) with the chat template, packs them and minimises cross-entropy
on the model's own turns only (what the environment wrote in between is context). The result,
``<sft.run_dir>/model``, is an HF directory: pass it as ``model.name`` to start RL from it.
"""

from __future__ import annotations

import logging
import time

from asyncrl.checkpoint import SFT_PARTS, is_checkpoint_step, prune_checkpoints, reconcile, resolve_resume
from asyncrl.config import Config
from asyncrl.numerics import configure_torch
from asyncrl.paths import RunDir
from asyncrl.utils.process import exit_wrapper, setup_logging

log = logging.getLogger("asyncrl.sft")


@exit_wrapper("sft")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    setup_logging("sft")
    configure_torch(cfg.numerics, cfg.trainer.fabric.num_threads)
    from asyncrl.config.compose import to_yaml
    from asyncrl.utils.meta import write_run_files
    from asyncrl.utils.seed import seed_everything

    run = RunDir(cfg.sft.run_dir).create()
    cfg_yaml = to_yaml(cfg)
    write_run_files(run, cfg, overrides)
    seed_everything(cfg.seed, cfg.deterministic)
    train_sft(cfg, run, cfg_yaml)


def train_sft(cfg: Config, run: RunDir, cfg_yaml: str) -> None:
    import torch

    from asyncrl.config.compose import to_dict
    from asyncrl.envs import PromptSampler, build_envs
    from asyncrl.models import eos_token_ids, render_conversation
    from asyncrl.monitor import build_monitor
    from asyncrl.rollouts.packing import Sample, pack_samples, truncate
    from asyncrl.trainer.common import batch_to_torch, build_train_state, export_final, step_over_micro_batches
    from asyncrl.trainer.loss import sft_loss

    sc = cfg.sft
    envs = build_envs(cfg.env, cfg.data_dir)
    missing = [n for n, e in envs.items() if e.demonstration(e.load("train")[0]) is None]
    if missing:
        raise ValueError(f"environments {missing} have no reference answers or demonstrations; SFT needs them")
    sampler = PromptSampler(envs, {n: s.weight for n, s in cfg.env.items()}, "train", cfg.seed)
    fabric, raw, tokenizer, state = build_train_state(cfg, sc.optim, sc.scheduler, sc.max_steps)
    end_ids = eos_token_ids(tokenizer, raw)  # where generation stops: a reply is trained up to its end token
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    resumed_at = resolve_resume(cfg, run, sft=True)  # newest that verifies; a damaged one is skipped, logged
    if resumed_at is not None:
        if fabric.global_rank == 0 and (removed := reconcile(run, resumed_at)):
            log.info(f"resuming from SFT checkpoint {resumed_at}; removed what was written after it: {removed}")
        fabric.barrier()
        rest = state.load(fabric, run.checkpoint(resumed_at, "trainer"))
        sampler.load_state_dict(rest["sampler"])
    monitor = (
        build_monitor(cfg.monitor, run.metrics_file("sft"), "sft", config=to_dict(cfg), resume_step=resumed_at)
        if fabric.global_rank == 0
        else None
    )

    def loss_fn(logprobs: torch.Tensor, mb: dict[str, torch.Tensor]):
        # the count stays a device tensor: step_over_micro_batches reads it with the losses, one host sync a step
        return sft_loss(logprobs, mb["loss_mask"][:, 1:], total_tokens), {"tokens": mb["loss_mask"].sum()}

    try:
        for step in range(state.progress.get("step", 0), sc.max_steps):
            t0 = time.monotonic()
            samples = []
            for _ in range(sc.batch_size):
                draw = sampler.draw()
                env = envs[draw.env]
                demo = env.demonstration(draw.example)
                if demo is None:
                    raise ValueError(
                        f"env.{draw.env} has no reference answer for {draw.example.get('id')} "
                        "(Environment.demonstration): SFT needs one for every example"
                    )
                prompt, completion, mask = render_conversation(tokenizer, env.prompt(draw.example), demo, end_ids)
                sample = Sample(prompt, completion, [0.0] * len(completion), 0.0, completion_mask=mask)
                s = truncate(sample, cfg.seq_len)
                if s is not None:
                    samples.append(s)
            mbs = pack_samples(
                samples,
                cfg.seq_len,
                tokenizer.pad_token_id,
                cfg.trainer.micro_batch_rows,
                multiple_of=fabric.world_size,
            )
            total_tokens = int(sum(int(mb["loss_mask"].sum()) for mb in mbs))
            mine = batch_to_torch(mbs[fabric.global_rank :: fabric.world_size])
            sums = step_over_micro_batches(fabric, model, optimizer, scheduler, mine, loss_fn, sc.optim.max_grad_norm)
            dt = time.monotonic() - t0
            state.progress = {"step": step + 1}
            if cfg.ckpt.interval and is_checkpoint_step(step + 1, cfg.ckpt.interval, sc.max_steps):
                state.save(fabric, run.checkpoint(step + 1, "trainer"), cfg_yaml, {"sampler": sampler.state_dict()})
                if fabric.global_rank == 0:
                    prune_checkpoints(run, cfg.ckpt.keep_last, SFT_PARTS)
            if monitor:
                tokens = sum(int(mb["input_ids"].size) for mb in mbs)
                monitor.log(
                    {
                        "sft/loss": sums["loss"],
                        "sft/grad_norm": sums["grad_norm"],
                        "sft/lr": scheduler.get_last_lr()[0],
                        "sft/tokens_per_s": tokens / max(dt, 1e-9),
                        "sft/loss_tokens": total_tokens,
                    },
                    step,
                )
                if step % 50 == 0 or step + 1 == sc.max_steps:
                    log.info(f"step {step}: loss {sums['loss']:.4f}")
        export_final(fabric, raw, tokenizer, cfg, run.model)
        log.info(f"model -> {run.model}")
    finally:
        if monitor:
            monitor.close()
