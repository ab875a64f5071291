"""RL and SFT losses (pure functions on tensors).

The default is PRIME-RL's ``default_loss_fn`` (docs/architecture.md, **Loss**): an importance ratio against the
*inference* logprobs (one ratio corrects both staleness and train/inference mismatch), a DPPO trust-region mask on
the probability difference chosen by the advantage's sign, and ``kl_tau * (log pi - log mu)^2``. No PPO
clip and no reference model. ``grpo`` swaps the masked term for the PPO-clip objective. Losses are
*sums* divided by ``total_tokens``, the loss-token count of the whole step, so micro-batches
accumulate to a token mean over the step (no per-sequence length normalisation).

``gspo`` (Zheng et al. 2025, arXiv:2507.18071) clips one ratio per *sequence*, the geometric mean of its
tokens' ratios, ``s = exp(mean_t (log pi - log mu))``: ``-min(s A, clip(s, 1 - eps_low, 1 + eps_high) A)``,
averaged over the step's sequences (each sequence weighs the same, as in the paper). ``cispo`` (MiniMax-M1,
arXiv:2506.13585) keeps every token's gradient and clips the importance weight instead:
``-sg(min(r, 1 + eps_high)) A log pi``, a token mean like the others. The ``kl_tau`` term applies to all four.

``trainer.kl.beta`` adds a penalty against a *reference* policy (the starting one), ``beta * k3`` per loss
token with ``k3 = exp(log ref - log pi) - (log ref - log pi) - 1`` (Schulman's unbiased, non-negative
estimator of KL(pi || ref) on tokens sampled from pi, as GRPO uses it), a token mean like the rest.

Online distillation (``distill.teacher``) adds ``weight * sg(log pi - log teacher) * ratio`` per loss token:
the policy gradient of the reverse KL to the teacher on the student's own samples, each token's log-ratio its
(negative) reward, importance-weighted like the policy term (on-policy distillation, Agarwal et al. 2024,
arXiv:2306.13649; with ``adv_tau = 0`` it is the only signal).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from asyncrl.config.trainer import LossConfig


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's inputs to :func:`rl_loss`, already shifted (every tensor ``[B, T-1]``), and the step's
    counts and penalty weights they are normalised and weighed by.

    ``gspo`` also needs ``seq_ids`` (which sample each token belongs to, :func:`sequence_ids`) and
    ``total_sequences``, the step's sample count, its denominator. With ``ref_logprobs`` (the reference
    policy's, no gradient) the KL penalty ``kl_beta * k3`` is added and its sum reported as ``kl_ref``; with
    ``teacher_logprobs`` the distillation term (``distill_weight``), its reverse-KL estimate summed as
    ``distill_kl``."""

    logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    total_tokens: int  # the loss-token count of the whole step
    _: KW_ONLY
    seq_ids: torch.Tensor | None = None
    total_sequences: int = 0
    ref_logprobs: torch.Tensor | None = None
    kl_beta: float = 0.0
    teacher_logprobs: torch.Tensor | None = None
    distill_weight: float = 0.0


def rl_loss(
    inputs: LossInputs, cfg: LossConfig, read_metrics: bool = True
) -> tuple[torch.Tensor, dict[str, float] | dict[str, torch.Tensor]]:
    """The RL loss of one micro-batch and its metric *sums*: floats, or with ``read_metrics=False`` 0-dim fp64
    tensors on the device, for the caller to read with the step's other values in one host sync
    (``asyncrl.trainer.step.step_over_micro_batches`` does) rather than stop here, between the forward and the
    backward, until the GPU has caught up."""
    logprobs, inference_logprobs, advantages = inputs.logprobs, inputs.inference_logprobs, inputs.advantages
    loss_mask, seq_ids, total_sequences = inputs.loss_mask, inputs.seq_ids, inputs.total_sequences
    ref_logprobs, teacher_logprobs = inputs.ref_logprobs, inputs.teacher_logprobs
    mask = loss_mask.float()
    seq_loss: torch.Tensor | float = 0.0  # gspo's policy term, per sequence
    log_ratio = logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    if cfg.type == "dppo_kl":
        delta = torch.exp(logprobs) - torch.exp(inference_logprobs)
        masked_high = (advantages > 0) & (delta > cfg.dppo_mask_high)
        masked_low = (advantages < 0) & (delta < -cfg.dppo_mask_low)
        keep = (~(masked_high | masked_low)).float()
        pg = -keep * cfg.adv_tau * advantages * ratio
    elif cfg.type == "grpo":
        clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
        pg = -cfg.adv_tau * torch.minimum(ratio * advantages, clipped * advantages)
        masked_high = (advantages > 0) & (ratio > 1 + cfg.clip_high)
        masked_low = (advantages < 0) & (ratio < 1 - cfg.clip_low)
    elif cfg.type == "cispo":
        # the weight is a constant (stop-gradient): every token's log pi gets A * weight, none is zeroed
        weight = torch.clamp(ratio, max=1 + cfg.cispo_clip_high).detach()
        pg = -cfg.adv_tau * weight * advantages * logprobs
        masked_high = ratio > 1 + cfg.cispo_clip_high  # weight capped (the token still trains)
        masked_low = torch.zeros_like(masked_high)
    elif cfg.type == "gspo":
        if seq_ids is None or total_sequences <= 0:
            raise ValueError("trainer.loss.type='gspo' needs each token's sequence and the step's sequence count")
        pg_seq, masked_high, masked_low = gspo_terms(log_ratio, advantages, mask, seq_ids, cfg)
        seq_loss = cfg.adv_tau * pg_seq / total_sequences
        pg = torch.zeros_like(log_ratio)
    else:
        raise ValueError(
            f"trainer.loss.type={cfg.type!r} is not allowed; allowed values: 'dppo_kl', 'grpo', 'gspo', 'cispo'"
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
    """Schulman's k3 estimator per token, ``exp(d) - d - 1``: with ``d = log q - log p`` on tokens sampled from
    ``p``, an unbiased, non-negative estimate of KL(p || q), zero where the two agree."""
    return torch.exp(d) - d - 1


def k3_sum(logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mismatch_kl``'s sum over ``mask`` (a 0-dim tensor, no gradient): the k3 estimate of KL(sampler || trainer)
    per token, on the sampler's tokens (``d = log pi - log mu``), in fp32 whatever the logprobs' dtype."""
    with torch.no_grad():
        return (k3((logprobs - inference_logprobs).float()) * mask.float()).sum()


def mismatch_kl_sum(logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """:func:`k3_sum` as a float."""
    return float(k3_sum(logprobs, inference_logprobs, mask))


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) (``d = log ref - log pi``): >= 0, zero where the two agree, and its
    gradient pulls ``log pi`` toward ``log ref``."""
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


def gspo_terms(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO's policy term summed over this micro-batch's sequences (negated: a loss), and per token whether its
    sequence was clipped above (A > 0) or below (A < 0). A sequence's ratio is over its loss tokens only; its
    advantage is its tokens' (one per sample)."""
    ids = seq_ids.reshape(-1)
    n = int(ids.max()) + 1 if ids.numel() else 0
    flat_mask = mask.reshape(-1)
    count = torch.zeros(n, dtype=mask.dtype, device=mask.device).index_add_(0, ids, flat_mask)
    lr_sum = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(
        0, ids, (log_ratio * mask).reshape(-1)
    )
    adv_sum = torch.zeros(n, dtype=advantages.dtype, device=advantages.device).index_add_(
        0, ids, (advantages * mask).reshape(-1)
    )
    has = count > 0
    denom = count.clamp(min=1)
    s = torch.exp(lr_sum / denom)
    adv = adv_sum / denom
    clipped = torch.clamp(s, 1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high)
    objective = torch.minimum(s * adv, clipped * adv)
    high = (adv > 0) & (s > 1 + cfg.gspo_clip_high) & has
    low = (adv < 0) & (s < 1 - cfg.gspo_clip_low) & has
    return -(objective * has).sum(), high[seq_ids], low[seq_ids]


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Cross-entropy on completion tokens, summed and divided by the step's token count."""
    return -(logprobs * loss_mask.float()).sum() / max(total_tokens, 1)


def sft_step_loss(
    total_tokens: int, logprobs: torch.Tensor, mb: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`sft_loss` of a packed micro-batch and its loss-token count, for ``step_over_micro_batches`` (bind
    ``total_tokens``, the step's count, with ``functools.partial``). The count stays a device tensor: the step reads
    it with the losses, one host sync a step."""
    return sft_loss(logprobs, mb["loss_mask"][:, 1:], total_tokens), {"tokens": mb["loss_mask"].sum()}
