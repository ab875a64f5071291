"""A trainer's state and how it is built: Fabric, the model (LoRA, compiled, checkpointed as configured), the
optimizer and schedule (:class:`TrainState`, what a checkpoint restores), the KL reference, and the final
export. Each ``build_*`` constructs one component."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning_fabric import Fabric

from asyncrl.config import Config
from asyncrl.config.trainer import FabricConfig, OptimConfig, SchedulerConfig
from asyncrl.models.adapters import is_adapter_name, is_lora_model
from asyncrl.models.hf import load_model, load_tokenizer
from asyncrl.models.moe import Routing, routers
from asyncrl.numerics import use_fused_adamw
from asyncrl.trainer.forward import compiled_logprobs
from asyncrl.trainer.optim import build_optimizer, build_scheduler
from asyncrl.trainer.parallel import (
    apply_activation_checkpointing,
    build_strategy,
    compile_layers,
    is_sharded,
)
from asyncrl.transport.gather import export_model
from asyncrl.utils.atomic import remove_dir, seal
from asyncrl.utils.seed import rng_state, set_rng_state


def build_fabric(cfg: FabricConfig):
    strategy, precision = build_strategy(cfg)
    fabric = Fabric(
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=strategy,
        **({"precision": precision} if isinstance(precision, str) else {"plugins": [precision]}),
    )
    fabric.launch()
    return fabric


@dataclass
class TrainState:
    """Everything a trainer checkpoint restores."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    progress: dict = field(default_factory=dict)

    def save(self, fabric, path: Path, cfg_yaml: str, extra: dict | None = None) -> None:
        """A checkpoint directory, atomic across ranks: every rank writes its shard into one temporary
        directory that rank 0 created; rank 0 renames it and writes the marker once all are done.

        A LoRA model's checkpoint holds its adapters (and optimizer), not the frozen base, which a resume
        loads from ``model.name`` again; except under FSDP2, whose sharded checkpoints cannot be filtered
        (Lightning refuses, pytorch#105379) and hold the base shards too."""
        lora = is_lora_model(self.model)
        filt = {"model": lambda k, v: is_adapter_name(k)} if lora and not is_sharded(self.model) else None
        tmp = path.with_name(f".{path.name}.tmp")
        if fabric.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / "config.yaml").write_text(cfg_yaml)
        fabric.barrier()
        fabric.save(
            tmp / "state.ckpt",
            {
                "model": self.model,
                "optimizer": self.optimizer,
                "scheduler": self.scheduler,
                "progress": dict(self.progress),
                "rng": rng_state(),
                **(extra or {}),
            },
            filter=filt,
        )
        fabric.barrier()
        if fabric.global_rank == 0:
            remove_dir(path)  # marker first: a resume never takes a half-deleted checkpoint as complete
            os.replace(tmp, path)
            seal(path, digest=True)  # a resume verifies the checkpoint against these sums before loading it
        fabric.barrier()

    def load(self, fabric, path: Path) -> dict:
        state = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}
        # our own checkpoint (RNG states hold numpy arrays), so full unpickling is fine
        rest = fabric.load(path / "state.ckpt", state, strict=False, weights_only=False)
        self.progress = rest.get("progress", {})
        if "rng" in rest:
            set_rng_state(rest["rng"])
        return rest


def where(fabric, cfg: Config) -> dict:
    """Where the trainer's model runs, for ``model.attn_implementation=auto`` (it loads on the CPU first)."""
    return {"runs_on": fabric.device, "context_parallel": cfg.trainer.fabric.context_parallel}


def build_reference(fabric, cfg: Config) -> torch.nn.Module:
    """The reference policy of the KL penalty: the starting policy, loaded again from ``model.name`` (so a
    resumed run gets the same one), frozen, and placed as the trained model is: sharded the same way under
    FSDP2 (its forward is a collective there too), on the device otherwise (DDP refuses a module with
    nothing to train, and a frozen copy needs no gradient sync). Its forward runs under ``fabric.autocast``,
    so a bf16-mixed run computes the reference in bf16 like the policy."""
    ref = load_model(cfg.model, dtype="float32", **where(fabric, cfg)).eval().requires_grad_(False)
    if cfg.trainer.fabric.strategy == "fsdp2":
        return fabric.setup_module(ref)
    return ref.to(fabric.device)


def build_train_state(
    cfg: Config, optim: OptimConfig, schedule: SchedulerConfig, total_steps: int, vllm_forward: bool = False
):
    """Fabric, the raw model, its tokenizer and the :class:`TrainState` (Fabric-wrapped model, optimizer,
    scheduler) of a trainer; ``raw`` is what weight export reads. ``vllm_forward``: the forward of
    ``numerics=bitwise`` (:mod:`asyncrl.models.bitwise`; the process called ``bitwise.enable()`` first)."""
    fabric = build_fabric(cfg.trainer.fabric)
    # fp32 master weights whatever the serving dtype; bf16-mixed computes in bf16 (see trainer/parallel.py)
    raw = load_model(cfg.model, dtype="float32", **where(fabric, cfg)).train()
    if cfg.model.lora.enabled:
        # peft costs ~0.6 s of CPU per start and only LoRA runs use it (python -X importtime -c "import
        # asyncrl.trainer.loop; import peft" 2>&1 | grep -w peft)
        from asyncrl.models.lora import apply_lora  # lazy: peft, for LoRA runs only

        raw = apply_lora(raw, cfg.model.lora)
    # before activation checkpointing and FSDP2 wrap the layers, so their hooks run around it
    if vllm_forward:
        # vLLM (GPU-only, absent on the CPU) loads with asyncrl.models.bitwise
        from asyncrl.models import bitwise  # lazy: vLLM's batch-invariant mode, GPU only

        bitwise.install(raw)
    if cfg.trainer.fabric.strategy != "fsdp2":  # FSDP2 applies both in parallelize()
        if cfg.trainer.fabric.activation_checkpointing:
            fc = cfg.trainer.fabric
            apply_activation_checkpointing(
                raw,
                sharded=False,
                every=fc.activation_checkpointing_every,
                saves=fc.activation_checkpointing_saves,
            )
        if cfg.trainer.fabric.compile:
            compile_layers(raw)
    if cfg.trainer.fabric.compile:
        raw.asyncrl_token_logprobs = compiled_logprobs()
    # a mixture of experts: the sampler's routes compared, and replayed with trainer.router_replay
    if routers(raw):
        raw.asyncrl_routing = Routing(raw, cfg.trainer.router_replay)
    tokenizer = load_tokenizer(cfg.model)
    # the optimizer must see the parameters after setup: FSDP2 replaces them with sharded DTensors
    model = fabric.setup_module(raw)
    fused = use_fused_adamw(cfg.numerics, cfg.trainer.fabric.accelerator)
    optimizer = fabric.setup_optimizers(build_optimizer(raw, optim, fused))
    scheduler = build_scheduler(optimizer, schedule, total_steps)
    return fabric, raw, tokenizer, TrainState(model, optimizer, scheduler, {"step": 0})


def export_final(fabric, raw_model, tokenizer, cfg: Config, model_dir: Path) -> None:
    """The run's final policy as a plain HF model at ``model_dir`` (what evals and the next stage load). With
    LoRA: the adapter goes to ``<model_dir>/../adapter`` and base + adapter, merged, to ``model_dir``."""
    if not is_lora_model(raw_model):
        export_model(fabric, raw_model, tokenizer, model_dir, cfg.model.dtype)
        return

    adapter = model_dir.parent / "adapter"
    export_model(fabric, raw_model, tokenizer, adapter, cfg.model.dtype)
    if fabric.global_rank == 0:
        # lazy: peft, for LoRA runs only (see build_train_state)
        from asyncrl.models.lora import merge_adapter

        merge_adapter(cfg.model, adapter, model_dir)
    fabric.barrier()
