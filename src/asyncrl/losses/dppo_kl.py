"""``trainer.loss.type=dppo_kl``, the default: PRIME-RL's ``default_loss_fn`` (docs/architecture.md,
**Loss**). An importance ratio against the *inference* logprobs (one ratio corrects both staleness and
train/inference mismatch) and a DPPO trust-region mask on the probability difference, chosen by the
advantage's sign; no PPO clip and no reference model. Its settings: ``trainer.loss.dppo_kl.*``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.losses.base import Loss, LossInputs, PolicyTerm

if TYPE_CHECKING:
    import torch

    from asyncrl.config.trainer import LossConfig


class DPPOKL(Loss):
    name = "dppo_kl"

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
        delta = inputs.logprobs.exp() - inputs.inference_logprobs.exp()
        masked_high = (advantages > 0) & (delta > cfg.dppo_kl.mask_high)
        masked_low = (advantages < 0) & (delta < -cfg.dppo_kl.mask_low)
        keep = (~(masked_high | masked_low)).float()
        return PolicyTerm(-keep * cfg.adv_tau * advantages * ratio, masked_high, masked_low)
