"""RL and SFT losses (pure functions on tensors).

The RL loss is the policy-gradient term of ``trainer.loss.type`` (one module each in :mod:`asyncrl.losses`,
PRIME-RL's the default, or a user's own) plus
``kl_tau * (log pi - log mu)^2`` against the inference policy. Losses are *sums* divided by ``total_tokens``,
the loss-token count of the whole step, so micro-batches accumulate to a token mean over the step (no
per-sequence length normalisation; a sequence-level loss adds its own mean over the step's sequences).

``trainer.kl.beta`` adds a penalty against a *reference* policy (the starting one), ``beta * k3`` per loss
token with ``k3 = exp(log ref - log pi) - (log ref - log pi) - 1`` (Schulman's unbiased, non-negative
estimator of KL(pi || ref) on tokens sampled from pi, as GRPO uses it), a token mean like the rest.

Online distillation (``distill.teacher``) adds ``weight * sg(log pi - log teacher) * ratio`` per loss token:
the policy gradient of the reverse KL to the teacher on the student's own samples, each token's log-ratio its
(negative) reward, importance-weighted like the policy term (on-policy distillation, Agarwal et al. 2024,
arXiv:2306.13649; with ``adv_tau = 0`` it is the only signal).
"""

from __future__ import annotations

import torch

from asyncrl.config.trainer import LossConfig
from asyncrl.config.variants import LOSSES
from asyncrl.losses.base import LossInputs


def rl_loss(
    inputs: LossInputs, cfg: LossConfig, read_metrics: bool = True
) -> tuple[torch.Tensor, dict[str, float] | dict[str, torch.Tensor]]:
    """The RL loss of one micro-batch and its metric *sums*: floats, or with ``read_metrics=False`` 0-dim
    fp64 tensors on the device, for the caller to read with the step's other values in one host sync
    (``asyncrl.trainer.step.step_over_micro_batches`` does) rather than stop here, between the forward and
    the backward, until the GPU has caught up."""
    logprobs, inference_logprobs, loss_mask = inputs.logprobs, inputs.inference_logprobs, inputs.loss_mask
    ref_logprobs, teacher_logprobs = inputs.ref_logprobs, inputs.teacher_logprobs
    mask = loss_mask.float()
    log_ratio = logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    term = LOSSES.get(cfg.type).policy_term(cfg, inputs, log_ratio, ratio, mask)
    pg, seq_loss, masked_high, masked_low = (
        term.per_token,
        term.per_sequence,
        term.masked_high,
        term.masked_low,
    )
    per_token = pg + cfg.kl_tau * log_ratio.pow(2)
    kl_ref = reference_kl(logprobs, ref_logprobs) if ref_logprobs is not None else None
    if kl_ref is not None and inputs.kl_beta > 0:
        per_token = per_token + inputs.kl_beta * kl_ref
    distill_kl = (logprobs - teacher_logprobs).detach() if teacher_logprobs is not None else None
    if distill_kl is not None and inputs.distill_weight > 0:
        per_token = per_token + inputs.distill_weight * distill_kl * ratio
    loss = (per_token * mask).sum() / max(inputs.total_tokens, 1) + seq_loss
    with torch.no_grad():
        sums = {
            "mismatch_kl": k3_sum(logprobs, inference_logprobs, loss_mask),
            "ratio": (ratio * mask).sum(),
            "masked_high": (masked_high.float() * mask).sum(),
            "masked_low": (masked_low.float() * mask).sum(),
            "tokens": mask.sum(),
        }
        if kl_ref is not None:
            sums["kl_ref"] = (kl_ref * mask).sum()
        if distill_kl is not None:
            sums["distill_kl"] = (distill_kl * mask).sum()
        unread = {k: v.double() for k, v in sums.items()}  # exact for fp32 and fp64
    if not read_metrics:
        return loss, unread
    # one host sync for all of them: each float() would stop the CPU until the GPU caught up
    return loss, dict(zip(unread, torch.stack(list(unread.values())).tolist(), strict=True))


def k3(d: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator per token, ``exp(d) - d - 1``: with ``d = log q - log p`` on tokens sampled
    from ``p``, an unbiased, non-negative estimate of KL(p || q), zero where the two agree."""
    return torch.exp(d) - d - 1


def k3_sum(logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mismatch_kl``'s sum over ``mask`` (a 0-dim tensor, no gradient): the k3 estimate of KL(sampler ||
    trainer) per token, on the sampler's tokens (``d = log pi - log mu``), in fp32 whatever the logprobs'
    dtype."""
    with torch.no_grad():
        return (k3((logprobs - inference_logprobs).float()) * mask.float()).sum()


def mismatch_kl_sum(logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """:func:`k3_sum` as a float."""
    return float(k3_sum(logprobs, inference_logprobs, mask))


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) (``d = log ref - log pi``): >= 0, zero where the two agree, and
    its gradient pulls ``log pi`` toward ``log ref``."""
    return k3(ref_logprobs.detach() - logprobs)


def adapt_kl_beta(beta: float, kl: float, target_kl: float, rate: float) -> float:
    """The next step's KL weight (Ziegler et al. 2019, arXiv:1909.08593, section 2.2): the relative error
    ``kl / target - 1`` clipped to +-0.2, times ``rate``, scales beta; a KL above target raises it. A
    ``target_kl`` of 0 keeps beta fixed."""
    if target_kl <= 0:
        return beta
    error = min(max(kl / target_kl - 1.0, -0.2), 0.2)
    return beta * (1.0 + rate * error)


def sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which packed sample each position belongs to, ``[B, T]``, unique across rows: a sample starts where
    its position id is 0 (see :mod:`asyncrl.rollouts.packing`; the padding is a sample of its own)."""
    starts = (position_ids == 0).long()
    rows = torch.arange(position_ids.shape[0], device=position_ids.device)[:, None] * position_ids.shape[1]
    return torch.cumsum(starts, dim=1) - 1 + rows


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Cross-entropy on completion tokens, summed and divided by the step's token count."""
    return -(logprobs * loss_mask.float()).sum() / max(total_tokens, 1)


def sft_step_loss(
    total_tokens: int, logprobs: torch.Tensor, mb: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`sft_loss` of a packed micro-batch and its loss-token count, for ``step_over_micro_batches``
    (bind ``total_tokens``, the step's count, with ``functools.partial``). The count stays a device tensor:
    the step reads it with the losses, one host sync a step."""
    return sft_loss(logprobs, mb["loss_mask"][:, 1:], total_tokens), {"tokens": mb["loss_mask"].sum()}
