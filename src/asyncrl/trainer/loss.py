"""RL and SFT losses (pure functions on tensors).

The default is PRIME-RL's ``default_loss_fn`` (notes §1.4): an importance ratio against the *inference*
logprobs (one ratio corrects both staleness and train/inference mismatch), a DPPO trust-region mask on
the probability difference chosen by the advantage's sign, and ``kl_tau * (log pi - log mu)^2``. No PPO
clip and no reference model. ``grpo`` swaps the masked term for the PPO-clip objective. Losses are
*sums* divided by ``total_tokens``, the loss-token count of the whole step, so micro-batches
accumulate to a token mean over the step (no per-sequence length normalisation).
"""

from __future__ import annotations

import torch

from asyncrl.config.sections import LossConfig


def compute_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Logprob of each token ``input_ids[:, i]`` given the prefix, for ``i >= 1``: shape ``[B, T-1]``.

    Logits at position ``i-1`` predict token ``i`` and are divided by the temperature token ``i``
    was sampled at, matching the sidecar's processed logprobs.
    """
    logits = logits[:, :-1].float() / temperatures[:, 1:, None]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def rl_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig,
    total_tokens: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The RL loss of one micro-batch (already shifted: all tensors ``[B, T-1]``) and its metric *sums*."""
    mask = loss_mask.float()
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
    else:
        raise ValueError(f"trainer.loss.type={cfg.type!r} is not allowed; allowed values: 'dppo_kl', 'grpo'")
    per_token = pg + cfg.kl_tau * log_ratio.pow(2)
    loss = (per_token * mask).sum() / max(total_tokens, 1)
    with torch.no_grad():
        metrics = {
            "mismatch_kl": float(((ratio - log_ratio - 1) * mask).sum()),  # k3 estimator of KL(mu || pi)
            "ratio": float((ratio * mask).sum()),
            "masked_high": float((masked_high.float() * mask).sum()),
            "masked_low": float((masked_low.float() * mask).sum()),
            "tokens": float(mask.sum()),
        }
    return loss, metrics


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Cross-entropy on completion tokens, summed and divided by the step's token count."""
    return -(logprobs * loss_mask.float()).sum() / max(total_tokens, 1)
