"""The RL step's loss function: each micro-batch's :class:`asyncrl.trainer.loss.LossInputs` (the reference
policy's logprobs under the KL penalty, the teacher's under distillation, each token's sequence for a
sequence-level loss), the step's
counts it is normalised by, and the KL weight that adapts from step to step (``trainer.kl.target_kl``)."""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.config import Config
from asyncrl.config.variants import LOSSES
from asyncrl.trainer.forward import OUTSIDE, packed_logprobs
from asyncrl.trainer.loss import LossInputs, adapt_kl_beta, rl_loss, sequence_ids
from asyncrl.trainer.state import build_reference


class RLObjective:
    """``loss(logprobs, micro_batch)`` for :func:`asyncrl.trainer.step.step_over_micro_batches`;
    :meth:`start_step` sets what the step's micro-batches share, :meth:`finish_step` turns its sums into the
    KL metrics."""

    def __init__(self, cfg: Config, fabric, model: torch.nn.Module, raw: Any, kl_beta: float):
        self.fabric, self.model, self.raw = fabric, model, raw
        self.loss_cfg, self.kl_cfg, self.distill_weight = (
            cfg.trainer.loss,
            cfg.trainer.kl,
            cfg.distill.weight,
        )
        self.sequence_level = LOSSES.get(cfg.trainer.loss.type).sequence_level  # needs each token's sequence
        self.kl_on = cfg.trainer.kl.beta > 0
        self.kl_beta = kl_beta  # a checkpoint keeps the current one
        # the reference of a LoRA run is the policy with its adapters switched off (no second copy)
        self.reference = build_reference(fabric, cfg) if self.kl_on and not cfg.model.lora.enabled else None
        self.total_tokens = self.total_sequences = 0
        self.ratios: list[torch.Tensor] | None = None  # the loss tokens' importance ratios, when recorded

    def start_step(self, meta: dict, record_ratios: bool) -> None:
        """The step's loss-token and sample counts (``meta`` of its rollouts), and whether to keep the
        ratios."""
        self.total_tokens, self.total_sequences = meta["loss_tokens"], meta.get("num_samples", 0)
        self.ratios = [] if record_ratios else None

    def reference_logprobs(self, mb: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if self.reference is not None:
            with torch.no_grad(), self.fabric.autocast():
                return packed_logprobs(self.reference, mb)
        if self.kl_on:  # LoRA
            with torch.no_grad(), self.raw.disable_adapter():
                return packed_logprobs(self.model, mb)
        return None

    def loss(self, logprobs: torch.Tensor, mb: dict[str, torch.Tensor]):
        outside = mb.get(OUTSIDE)  # read before the reference's forward, which sets its own
        if self.ratios is not None:
            with torch.no_grad():
                mask = mb["loss_mask"][:, 1:].bool()
                self.ratios.append(torch.exp(logprobs - mb["inference_logprobs"][:, 1:])[mask].float().cpu())
        inputs = LossInputs(
            logprobs,
            mb["inference_logprobs"][:, 1:],
            mb["advantages"][:, 1:],
            mb["loss_mask"][:, 1:],
            self.total_tokens,
            seq_ids=sequence_ids(mb["position_ids"])[:, 1:] if self.sequence_level else None,
            total_sequences=self.total_sequences,
            ref_logprobs=self.reference_logprobs(mb),
            kl_beta=self.kl_beta,
            teacher_logprobs=mb["teacher_logprobs"][:, 1:] if "teacher_logprobs" in mb else None,
            distill_weight=self.distill_weight,
        )
        # step_over_micro_batches reads them once
        loss, sums = rl_loss(inputs, self.loss_cfg, read_metrics=False)
        if outside is None:
            return loss, sums
        return loss, {**sums, "truncation_outside": (outside & mb["loss_mask"][:, 1:].bool()).sum().double()}

    def finish_step(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's KL metrics, per loss token, then the next step's KL weight (the same on every rank)."""
        n = max(sums.get("tokens", 0.0), 1.0)
        metrics: dict[str, float] = {}
        if "distill_kl" in sums:  # online distillation: the reverse KL to the teacher, per loss token
            metrics["train/distill_kl"] = sums["distill_kl"] / n
        # sampled tokens below the trainer's kept set (asyncrl.models.truncation)
        if "truncation_outside" in sums:
            metrics["train/truncation_outside_frac"] = sums["truncation_outside"] / n
        if "behavior_kl" in sums:
            metrics["train/behavior_kl"] = sums["behavior_kl"] / n
        if self.kl_on:  # the weight this step used, then the next step's
            metrics.update({"train/kl_ref": sums.get("kl_ref", 0.0) / n, "train/kl_beta": self.kl_beta})
            kl = self.kl_cfg
            self.kl_beta = adapt_kl_beta(self.kl_beta, metrics["train/kl_ref"], kl.target_kl, kl.adapt_rate)
        return metrics

    def progress(self, done: int) -> dict:
        """What a checkpoint after ``done`` steps records of the loop."""
        return {"step": done, **({"kl_beta": self.kl_beta} if self.kl_on else {})}
