"""An RL loss: the policy-gradient term of ``trainer.loss.type``, one class per loss.

``trainer.loss.type`` names a :class:`Loss` subclass through the registry
(:data:`asyncrl.config.variants.LOSSES`): a built-in's name (one module each in :mod:`asyncrl.losses`) or a
user's ``package.module:Class``. A loss answers its config errors (``trainer.loss.args`` holds a user's
loss's own settings), whether it works on whole sequences (:attr:`Loss.sequence_level`: the trainer then
passes each token's sequence and the step's sequence count, and context parallelism is refused), and
:meth:`Loss.policy_term`. What every loss shares (the ``kl_tau`` term, the reference KL, distillation, the
step's token mean, the metrics) is :func:`asyncrl.trainer.loss.rl_loss`'s.

Torch-free at import (the config checks, which every process runs, read the classes): a loss computes with
the tensors' own methods.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from asyncrl.config.variants import overrides

if TYPE_CHECKING:
    import torch

    from asyncrl.config import Config
    from asyncrl.config.trainer import LossConfig


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's inputs to the loss, already shifted (every tensor ``[B, T-1]``), and the step's
    counts and penalty weights they are normalised and weighed by.

    A sequence-level loss also gets ``seq_ids`` (which sample each token belongs to,
    :func:`asyncrl.trainer.loss.sequence_ids`) and ``total_sequences``, the step's sample count. With
    ``ref_logprobs`` (the reference policy's, no gradient) the KL penalty ``kl_beta * k3`` is added and its
    sum reported as ``kl_ref``; with ``teacher_logprobs`` the distillation term (``distill_weight``), its
    reverse-KL estimate summed as ``distill_kl``."""

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


@dataclass(frozen=True)
class PolicyTerm:
    """A loss's policy-gradient term for one micro-batch: ``per_token`` (summed over loss tokens, divided by
    the step's token count), ``per_sequence`` (added as it is: a sequence-level loss's own mean), and per
    token whether the loss clipped or masked it above or below (``train/masked_high``, ``masked_low``)."""

    per_token: Any
    masked_high: Any
    masked_low: Any
    per_sequence: Any = 0.0


class Loss:
    """What every loss answers; a subclass gives :meth:`policy_term` and changes the rest where it
    differs."""

    name: ClassVar[str] = ""
    sequence_level: ClassVar[bool] = False
    # whether it reads settings of its own from ``trainer.loss.args`` (a user's loss; the built-ins' sections
    # are in the schema, ``trainer.loss.<name>``)
    takes_args: ClassVar[bool] = False

    @classmethod
    def missing_hooks(cls) -> list[str]:
        """``["policy_term"]`` when this loss does not define it (the registry refuses it when the config is
        checked)."""
        return [] if overrides(cls, Loss, "policy_term") else ["policy_term"]

    @classmethod
    def config_errors(cls, cfg: Config) -> list[str]:
        """Why ``cfg`` (the whole config) cannot use this loss (empty when it can): ``trainer.loss.args``
        only for one that :attr:`takes_args`."""
        if (args := dict(cfg.trainer.loss.args)) and not cls.takes_args:
            return [f"trainer.loss.args={args}: trainer.loss.type={cfg.trainer.loss.type} takes no args"]
        return []

    @classmethod
    def policy_term(
        cls,
        cfg: LossConfig,
        inputs: LossInputs,
        log_ratio: torch.Tensor,
        ratio: torch.Tensor,
        mask: torch.Tensor,
    ) -> PolicyTerm:
        """The policy term of ``inputs`` (``cfg``: ``trainer.loss``, where a loss's settings are, its
        ``args`` or a built-in's own section; ``log_ratio``/``ratio``: log pi - log mu and its exp; ``mask``:
        the loss mask as floats)."""
        raise NotImplementedError


def no_tokens(like: torch.Tensor) -> torch.Tensor:
    """Zeros (all false) per token, of ``like``'s shape and dtype (a per-token bool mask)."""
    return like.new_zeros(like.shape)
