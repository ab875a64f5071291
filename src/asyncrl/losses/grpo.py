"""``trainer.loss.type=grpo``: the PPO-clip objective on each token's ratio against the inference policy,
``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``. Its settings: ``trainer.loss.grpo.*``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.losses.base import Loss, LossInputs, PolicyTerm

if TYPE_CHECKING:
    import torch

    from asyncrl.config.trainer import LossConfig


class GRPO(Loss):
    name = "grpo"

    @classmethod
    def policy_term(
        cls,
        cfg: LossConfig,
        inputs: LossInputs,
        log_ratio: torch.Tensor,
        ratio: torch.Tensor,
        mask: torch.Tensor,
    ) -> PolicyTerm:
        advantages = inputs.advantages
        clipped = ratio.clamp(1 - cfg.grpo.clip_low, 1 + cfg.grpo.clip_high)
        pg = -cfg.adv_tau * (ratio * advantages).minimum(clipped * advantages)
        masked_high = (advantages > 0) & (ratio > 1 + cfg.grpo.clip_high)
        masked_low = (advantages < 0) & (ratio < 1 - cfg.grpo.clip_low)
        return PolicyTerm(pg, masked_high, masked_low)
