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
from functools import partial

from asyncrl.checkpoint import SFT_PARTS, is_checkpoint_step, prune_checkpoints, reconcile, resolve_resume
from asyncrl.config import Config
from asyncrl.monitor import wandb_offline_note
from asyncrl.numerics import configure_torch
from asyncrl.paths import RunDir
from asyncrl.trainer.perf import batch_lengths, gpu_name, mfu_metrics, step_flops
from asyncrl.utils.process import exit_wrapper, setup_logging

log = logging.getLogger("asyncrl.sft")


@exit_wrapper("sft")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    setup_logging("sft")
    configure_torch(cfg.numerics, cfg.trainer.fabric.num_threads)
    from asyncrl.config.compose import to_yaml  # lazy: torch loads after configure_torch
    from asyncrl.utils.meta import write_run_files  # lazy: torch loads after configure_torch
    from asyncrl.utils.seed import seed_everything  # lazy: torch loads after configure_torch

    run = RunDir(cfg.sft.run_dir).create()
    cfg_yaml = to_yaml(cfg)
    write_run_files(run, cfg, overrides)
    seed_everything(cfg.seed, cfg.deterministic)
    if note := wandb_offline_note(cfg.monitor, run.root):
        log.info(note)
    train_sft(cfg, run, cfg_yaml)
    if note := wandb_offline_note(cfg.monitor, run.root):
        log.info(note)


def train_sft(cfg: Config, run: RunDir, cfg_yaml: str) -> None:
    # imported here, after main's configure_torch set the environment torch reads at import: this entry
    # module stays torch-free until then
    from asyncrl.config.compose import to_dict  # lazy: after configure_torch
    from asyncrl.envs import PromptSampler, build_envs  # lazy: after configure_torch
    from asyncrl.models.hf import eos_token_ids  # lazy: after configure_torch
    from asyncrl.monitor import build_monitor  # lazy: after configure_torch
    from asyncrl.rollouts.packing import pack_samples  # lazy: after configure_torch
    from asyncrl.trainer.forward import batch_to_torch  # lazy: after configure_torch
    from asyncrl.trainer.loss import sft_step_loss  # lazy: after configure_torch
    from asyncrl.trainer.state import build_train_state, export_final  # lazy: after configure_torch
    from asyncrl.trainer.step import step_over_micro_batches  # lazy: after configure_torch

    sc = cfg.sft
    envs = build_envs(cfg.env, cfg.data_dir)
    missing = [n for n, e in envs.items() if e.demonstration(e.load("train")[0]) is None]
    if missing:
        raise ValueError(
            f"environments {missing} have no reference answers or demonstrations; SFT needs them"
        )
    sampler = PromptSampler(envs, {n: s.weight for n, s in cfg.env.items()}, "train", cfg.seed)
    fabric, raw, tokenizer, state = build_train_state(cfg, sc.optim, sc.scheduler, sc.max_steps)
    end_ids = eos_token_ids(tokenizer, raw)  # where generation stops: a reply is trained up to its end token
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    resumed_at = resume_sft(cfg, run, fabric, state, sampler)
    gpu = gpu_name(fabric.device)
    monitor = (
        build_monitor(
            cfg.monitor, run.metrics_file("sft"), "sft", config=to_dict(cfg), resume_step=resumed_at
        )
        if fabric.global_rank == 0
        else None
    )

    try:
        for step in range(state.progress.get("step", 0), sc.max_steps):
            t0 = time.monotonic()
            samples = demonstrations(sampler, envs, tokenizer, end_ids, sc.batch_size, cfg.seq_len)
            mbs = pack_samples(
                samples,
                cfg.seq_len,
                tokenizer.pad_token_id,
                cfg.trainer.micro_batch_rows,
                multiple_of=fabric.world_size,
            )
            total_tokens = int(sum(int(mb["loss_mask"].sum()) for mb in mbs))
            mine = batch_to_torch(mbs[fabric.global_rank :: fabric.world_size])
            loss_fn = partial(sft_step_loss, total_tokens)
            sums = step_over_micro_batches(
                fabric, model, optimizer, scheduler, mine, loss_fn, max_grad_norm=sc.optim.max_grad_norm
            )
            dt = time.monotonic() - t0
            state.progress = {"step": step + 1}
            if cfg.ckpt.interval and is_checkpoint_step(step + 1, cfg.ckpt.interval, sc.max_steps):
                state.save(
                    fabric, run.checkpoint(step + 1, "trainer"), cfg_yaml, {"sampler": sampler.state_dict()}
                )
                if fabric.global_rank == 0:
                    prune_checkpoints(run, cfg.ckpt.keep_last, SFT_PARTS)
            if monitor:
                # every rank's samples are in mbs: the step's FLOPs need no collective
                mfu = mfu_metrics(
                    "sft", step_flops(raw.config, batch_lengths(mbs)), dt, gpu, fabric.world_size
                )
                log_sft_step(
                    monitor, step, sums, lr=scheduler.get_last_lr()[0], mbs=mbs, dt=dt,
                    total_tokens=total_tokens, max_steps=sc.max_steps, mfu=mfu,
                )  # fmt: skip
        export_final(fabric, raw, tokenizer, cfg, run.model)
        log.info(f"model -> {run.model}")
    finally:
        if monitor:
            monitor.close()


def demonstrations(sampler, envs, tokenizer, end_ids: list[int], n: int, seq_len: int) -> list:
    """``n`` drawn examples rendered with their demonstrations (over-long ones cut to ``seq_len``, empty ones
    dropped)."""
    from asyncrl.models.hf import render_conversation  # lazy: after configure_torch
    from asyncrl.rollouts.packing import Sample, truncate  # lazy: after configure_torch

    samples = []
    for _ in range(n):
        draw = sampler.draw()
        env = envs[draw.env]
        demo = env.demonstration(draw.example)
        if demo is None:
            raise ValueError(
                f"env.{draw.env} has no reference answer for {draw.example.get('id')} "
                "(Environment.demonstration): SFT needs one for every example"
            )
        prompt, completion, mask = render_conversation(
            tokenizer, env.prompt(draw.example), demo, end_ids, tools=env.tools(draw.example)
        )
        s = truncate(Sample(prompt, completion, [0.0] * len(mask), 0.0, completion_mask=mask), seq_len)
        if s is not None:
            samples.append(s)
    return samples


def resume_sft(cfg: Config, run: RunDir, fabric, state, sampler) -> int | None:
    """Load the newest SFT checkpoint that verifies (a damaged one is skipped, logged) into ``state`` and
    ``sampler``, after removing what was written after it; its step, or ``None`` for a fresh run."""
    resumed_at = resolve_resume(cfg, run, sft=True)
    if resumed_at is not None:
        if fabric.global_rank == 0 and (removed := reconcile(run, resumed_at)):
            log.info(
                f"resuming from SFT checkpoint {resumed_at}; removed what was written after it: {removed}"
            )
        fabric.barrier()
        rest = state.load(fabric, run.checkpoint(resumed_at, "trainer"))
        sampler.load_state_dict(rest["sampler"])
    return resumed_at


def log_sft_step(
    monitor,
    step: int,
    sums: dict[str, float],
    *,
    lr: float,
    mbs: list,
    dt: float,
    total_tokens: int,
    max_steps: int,
    mfu: dict[str, float],
) -> None:
    """The step's row of ``metrics/sft.jsonl`` (``mfu``: ``sft/mfu_6n`` and ``sft/mfu_attn`` on a GPU of
    known peak), and a progress line every 50 steps and at the end."""
    tokens = sum(int(mb["input_ids"].size) for mb in mbs)
    monitor.log(
        {
            "sft/loss": sums["loss"],
            "sft/grad_norm": sums["grad_norm"],
            "sft/lr": lr,
            "sft/tokens_per_s": tokens / max(dt, 1e-9),
            **mfu,
            "sft/loss_tokens": total_tokens,
        },
        step,
    )
    if step % 50 == 0 or step + 1 == max_steps:
        log.info(f"step {step}: loss {sums['loss']:.4f}")
