"""The policies that sampled a step's rollouts, kept so the trainer can score samples under them
(``trainer.behavior_kl``).

With ``async_level = k`` step ``n`` trains policy ``n`` on samples of policy ``n - k``; ``mismatch_kl`` compares
the sidecar's logprobs with policy ``n``'s, so it measures the policy's change since sampling *and* any
train/inference numerics mismatch. Scoring the samples under policy ``n - k`` itself leaves the mismatch alone
(``train/behavior_kl``): exactly 0 under ``numerics=bitwise``.

A policy is kept as bf16 copies of this rank's parameter shards: exact, because the sidecar serves (and the
bitwise forward computes with) the bf16 rounding of the fp32 masters, which is what the copy holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (an FSDP2 DTensor's local tensor shares its storage), else ``p``."""
    return p.to_local() if hasattr(p, "to_local") else p


class BehaviorPolicies:
    """bf16 copies of the last ``keep`` policies (by version) of ``params``, and a context that runs code with
    one of them in place of the live weights."""

    def __init__(self, params: list[torch.Tensor], keep: int):
        self.params, self.keep = params, keep
        self.kept: dict[int, list[torch.Tensor]] = {}

    @torch.no_grad()
    def snapshot(self, version: int) -> None:
        """Keep the live weights as policy ``version`` (dropping the oldest beyond ``keep``)."""
        if self.keep <= 0:
            return
        self.kept[version] = [_local(p).to(torch.bfloat16, copy=True) for p in self.params]
        for old in sorted(self.kept)[: -self.keep]:
            del self.kept[old]

    @contextmanager
    def swapped(self, version: int) -> Iterator[None]:
        """The live weights replaced by policy ``version``'s inside the block, restored after (even on error)."""
        live = [_local(p) for p in self.params]
        with torch.no_grad():
            saved = [t.clone() for t in live]
            for t, kept in zip(live, self.kept[version], strict=True):
                t.copy_(kept)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, s in zip(live, saved, strict=True):
                    t.copy_(s)


def behavior_k3(logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Sum over ``mask`` of the k3 estimate of KL(sampler || trainer) per token (as ``mismatch_kl``)."""
    log_ratio = (logprobs - inference_logprobs).float()
    return float(((torch.exp(log_ratio) - log_ratio - 1) * mask.float()).sum())
