"""``trainer.loss.type=gspo`` (Zheng et al. 2025, arXiv:2507.18071): one ratio per *sequence*, the geometric
mean of its tokens' ratios, ``s = exp(mean_t (log pi - log mu))``, clipped:
``-min(s A, clip(s, 1 - clip_low, 1 + clip_high) A)``, averaged over the step's sequences (each
sequence weighs the same, as in the paper). Its settings: ``trainer.loss.gspo.*``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.losses.base import Loss, LossInputs, PolicyTerm

if TYPE_CHECKING:
    import torch

    from asyncrl.config.trainer import LossConfig


class GSPO(Loss):
    name = "gspo"
    sequence_level = True

    @classmethod
    def policy_term(
        cls,
        cfg: LossConfig,
        inputs: LossInputs,
        log_ratio: torch.Tensor,
        ratio: torch.Tensor,
        mask: torch.Tensor,
    ) -> PolicyTerm:
        if inputs.seq_ids is None or inputs.total_sequences <= 0:
            raise ValueError(
                "trainer.loss.type='gspo' needs each token's sequence and the step's sequence count"
            )
        pg_seq, masked_high, masked_low = gspo_terms(log_ratio, inputs.advantages, mask, inputs.seq_ids, cfg)
        per_sequence = cfg.adv_tau * pg_seq / inputs.total_sequences
        return PolicyTerm(log_ratio.new_zeros(log_ratio.shape), masked_high, masked_low, per_sequence)


def gspo_terms(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO's policy term summed over this micro-batch's sequences (negated: a loss), and per token whether
    its sequence was clipped above (A > 0) or below (A < 0). A sequence's ratio is over its loss tokens only;
    its advantage is its tokens' (one per sample)."""
    ids = seq_ids.reshape(-1)
    n = int(ids.max()) + 1 if ids.numel() else 0
    flat_mask = mask.reshape(-1)
    count = mask.new_zeros(n).index_add_(0, ids, flat_mask)
    lr_sum = log_ratio.new_zeros(n).index_add_(0, ids, (log_ratio * mask).reshape(-1))
    adv_sum = advantages.new_zeros(n).index_add_(0, ids, (advantages * mask).reshape(-1))
    has = count > 0
    denom = count.clamp(min=1)
    s = (lr_sum / denom).exp()
    adv = adv_sum / denom
    clipped = s.clamp(1 - cfg.gspo.clip_low, 1 + cfg.gspo.clip_high)
    objective = (s * adv).minimum(clipped * adv)
    high = (adv > 0) & (s > 1 + cfg.gspo.clip_high) & has
    low = (adv < 0) & (s < 1 - cfg.gspo.clip_low) & has
    return -(objective * has).sum(), high[seq_ids], low[seq_ids]
