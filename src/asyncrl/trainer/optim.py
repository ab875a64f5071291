"""The optimizer side of a trainer step: AdamW, the learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from asyncrl.config.trainer import OptimConfig, SchedulerConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW; ``fused`` takes torch's single-kernel implementation (see
    :func:`asyncrl.numerics.use_fused_adamw`)."""
    # no weight decay on norms and biases (1-D parameters), as is standard for transformers
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )


def lr_factor(step: int, cfg: SchedulerConfig, total_steps: int) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (pure function)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    decay = 1 - progress if cfg.name == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor | None:
    """The global L2 norm of the gradients (a 0-dim tensor on their device, not read here: a host sync),
    clipped to ``max_norm`` (0 = measure only); None without gradients.

    Computed explicitly, as torchtitan does (``get_total_norm`` over the sharded gradients, then
    ``full_tensor()`` to reduce it across ranks), so the same code serves one device and FSDP2.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
