"""``trainer.loss.type=cispo`` (MiniMax-M1, arXiv:2506.13585): every token keeps its gradient and the
importance weight is clipped instead, ``-sg(min(r, 1 + clip_high)) A log pi``, a token mean like the
others. Its settings: ``trainer.loss.cispo.*``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.losses.base import Loss, LossInputs, PolicyTerm, no_tokens

if TYPE_CHECKING:
    import torch

    from asyncrl.config.trainer import LossConfig


class CISPO(Loss):
    name = "cispo"

    @classmethod
    def policy_term(
        cls,
        cfg: LossConfig,
        inputs: LossInputs,
        log_ratio: torch.Tensor,
        ratio: torch.Tensor,
        mask: torch.Tensor,
    ) -> PolicyTerm:
        # the weight is a constant (stop-gradient): every token's log pi gets A * weight, none is zeroed
        weight = ratio.clamp(max=1 + cfg.cispo.clip_high).detach()
        pg = -cfg.adv_tau * weight * inputs.advantages * inputs.logprobs
        masked_high = ratio > 1 + cfg.cispo.clip_high  # weight capped (the token still trains)
        return PolicyTerm(pg, masked_high, no_tokens(masked_high))
