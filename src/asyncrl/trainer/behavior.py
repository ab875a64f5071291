"""The policies that sampled a step's rollouts, kept so the trainer can score samples under them
(``trainer.behavior_kl``).

With ``async_level = k`` step ``n`` trains policy ``n`` on samples of policy ``n - k``; ``mismatch_kl``
compares the sidecar's logprobs with policy ``n``'s, so it measures the policy's change since sampling *and*
any train/inference numerics mismatch. Scoring the samples under policy ``n - k`` itself leaves the mismatch
alone (``train/behavior_kl``): exactly 0 under ``numerics=bitwise``.

A policy is kept as copies of this rank's shards of the trainable parameters in the serving dtype: exact for
the sidecar's side, which serves (and the bitwise forward computes with) the serving-dtype rounding of the
fp32 masters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule

from asyncrl.trainer.forward import micro_batch_to_device, packed_logprobs
from asyncrl.trainer.loss import mismatch_kl_sum


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (an FSDP2 DTensor's local tensor shares its storage), else ``p``."""
    return p.to_local() if hasattr(p, "to_local") else p


def _reshard(module: torch.nn.Module) -> None:
    """Free every FSDP2 unit's gathered parameters, so the next forward gathers the shards as they are now.

    FSDP2 keeps some units gathered after a forward (the root, and the last layer with
    ``reshard_after_forward=False``): without this, a forward after the shards changed would still see the
    old gathered copy, and the training step would run partly on the kept policy's weights."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class BehaviorPolicies:
    """Copies of the last ``keep`` policies (by version) of ``module``'s trainable parameters, in ``dtype``,
    and a context that runs code with one of them in place of the live weights."""

    def __init__(self, module: torch.nn.Module, keep: int, dtype: torch.dtype = torch.bfloat16):
        self.module, self.keep, self.dtype = module, keep, dtype
        self.params = [p for p in module.parameters() if p.requires_grad]  # frozen ones never change
        self.kept: dict[int, list[torch.Tensor]] = {}

    @torch.no_grad()
    def snapshot(self, version: int) -> None:
        """Keep the live weights as policy ``version`` (dropping the oldest beyond ``keep``)."""
        if self.keep <= 0:
            return
        self.kept[version] = [_local(p).to(self.dtype, copy=True) for p in self.params]
        for old in sorted(self.kept)[: -self.keep]:
            del self.kept[old]

    @contextmanager
    def swapped(self, version: int) -> Iterator[None]:
        """The live weights replaced by policy ``version``'s inside the block, restored after (even on
        error). Holds a transient copy of this rank's live shards meanwhile."""
        kept = self.kept[version]
        live = [_local(p) for p in self.params]
        with torch.no_grad():
            saved = [t.clone() for t in live]
        try:
            with torch.no_grad():
                _reshard(self.module)
                for t, k in zip(live, kept, strict=True):
                    t.copy_(k)
            yield
        finally:
            with torch.no_grad():
                _reshard(self.module)
                for t, s in zip(live, saved, strict=True):
                    t.copy_(s)

    def kl(self, model: torch.nn.Module, device, step: int, micro_batches: list[dict], versions: list[int]):
        """Sum of the k3 per loss token between the sidecar's logprobs and the sampling policy's here
        (``model`` is the wrapped module whose weights :meth:`swapped` replaces), or ``None`` when that
        policy is not at hand (samples of several policies, or from before a resume)."""
        if len(set(versions)) != 1 or versions[0] == step:
            return None  # at the live policy, the loss's own mismatch_kl is the behavior KL
        if versions[0] not in self.kept:
            return None
        total = 0.0
        with self.swapped(versions[0]), torch.no_grad():
            for mb in micro_batches:
                mb = micro_batch_to_device(mb, device)
                logprobs = packed_logprobs(model, mb)
                total += mismatch_kl_sum(logprobs, mb["inference_logprobs"][:, 1:], mb["loss_mask"][:, 1:])
        return total
