"""Top-k / top-p / min-p truncation of a sampling distribution: the rule the built-in engine samples with and
the trainer scores with, so that a token's importance ratio compares two logprobs of one distribution.

The rule is vLLM 0.26's sampler (``vllm/v1/worker/gpu/sample/sampler.py``), in its order: temperature, then
min-p (drop values below ``max + log(min_p)``), then top-k (drop values below the k-th largest), then top-p
on what is left (renormalised; in ascending order, drop values while the mass up to and including them is
``<= 1 - top_p``, never the largest). Each row's kept set is written as a :class:`Kept`: a *floor* (min-p's
threshold, or the smallest value top-k or top-p keeps) and, for top-p, the vocabulary index of the first
value kept in sort order. Top-p cuts the sorted row at a position, so among values tied with the floor it
keeps those sorted after the cut: in a stable ascending sort, the ties at indices from ``first`` on. vLLM
sorts with ``torch.sort``, which on CUDA is stable for rows over 32 values (an unstable bitonic sort below),
and logits rounded from bf16 tie often, so the trainer keeps exactly vLLM's set only by breaking ties the
same way.

The trainer scores a sampled token under its kept set, renormalised. A token outside it (logits that differ
by rounding between sampler and trainer) lowers the floor to its own value: it is scored among every token at
least as likely as itself, and counted (``train/truncation_outside_frac``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# the micro-batch arrays that carry each token's truncation (neutral values: 0, 1.0, 0.0), beside
# ``temperatures``
KEYS = ("top_ks", "top_ps", "min_ps")


class Kept(NamedTuple):
    """A kept set per row: values ``> floor`` are kept, and values ``== floor`` at vocabulary indices
    ``>= first`` (``first`` 0: every tie). ``floor`` ``-inf`` keeps all."""

    floor: torch.Tensor
    first: torch.Tensor

    def drops(self, x: torch.Tensor) -> torch.Tensor:
        """The values of ``x`` ``[..., V]`` outside the kept set (bool, same shape)."""
        floor = self.floor[..., None]
        out = x < floor
        if bool((self.first > 0).any()):
            index = torch.arange(x.shape[-1], device=x.device)
            out |= (x == floor) & (index < self.first[..., None])
        return out


def kept_set(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> Kept:
    """The kept set of each row of ``x`` ``[..., V]`` (temperature-scaled logits).

    ``top_k``, ``top_p``, ``min_p`` are ``x.shape[:-1]``; ``top_k <= 0``, ``top_p >= 1``, ``min_p <= 0`` are
    off. Computed in ``x``'s dtype, without gradient."""
    with torch.no_grad():
        vocab = x.shape[-1]
        floor = x.new_full(x.shape[:-1], float("-inf"))
        first = torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
        if bool((min_p > 0).any()):
            floor = x.amax(-1) + torch.log(min_p.to(x.dtype).clamp(min=0))  # log 0 = -inf: off
        do_k, do_p = bool(((top_k > 0) & (top_k < vocab)).any()), bool((top_p < 1).any())
        if not (do_k or do_p):
            return Kept(floor, first)
        # ascending, ties by index: vLLM's sort order (module docstring)
        s, order = x.sort(dim=-1, stable=True)
        s = s.masked_fill(s < floor[..., None], float("-inf"))
        if do_k:
            k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
            kth = s.gather(-1, (vocab - k)[..., None])
            floor = torch.maximum(floor, kth.squeeze(-1))
            s = s.masked_fill(s < kth, float("-inf"))
        if do_p:
            cum = s.softmax(-1).cumsum(-1)
            drop = cum <= (1 - top_p.to(x.dtype))[..., None]
            drop[..., -1] = False  # the largest value is always kept
            # cum never decreases: the dropped values are a prefix, and the first kept one is the floor
            at = drop.sum(-1, keepdim=True)
            cut = top_p < 1
            floor = torch.where(cut, torch.maximum(floor, s.gather(-1, at).squeeze(-1)), floor)
            first = torch.where(cut, order.gather(-1, at).squeeze(-1), first)
        return Kept(floor, first)


@dataclass
class Truncation:
    """Each position's ``top_k``, ``top_p``, ``min_p`` (``[B, T]``). A scoring function given one sets
    ``outside`` (``[B, T-1]`` bool, aligned with the logprobs it returns): the tokens that were outside their
    kept set."""

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    outside: torch.Tensor | None = None

    @classmethod
    def of(cls, mb: dict) -> Truncation | None:
        """The truncation a micro-batch records (aligned with its ``input_ids``), or ``None`` when it has
        none."""
        return cls(*(mb[k] for k in KEYS)) if KEYS[0] in mb else None

    def shifted(self, by: int = 1) -> Truncation:
        """Entries ``by:`` of each row: the settings of the tokens the logits at ``0, 1, ...`` predict."""
        return Truncation(self.top_k[:, by:], self.top_p[:, by:], self.min_p[:, by:])

    def sliced(self, s: slice) -> Truncation:
        """Positions ``s`` of each row (a chunk of the chunked head)."""
        return Truncation(self.top_k[:, s], self.top_p[:, s], self.min_p[:, s])

    def kept(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[Kept, torch.Tensor]:
        """Each row's kept set in ``x``'s dtype, widened to every value at least the target's where the
        target is outside it, and where that happened (``outside``, bool)."""
        with torch.no_grad():
            kept = kept_set(x, self.top_k, self.top_p, self.min_p)
            target = x.gather(-1, targets[..., None]).squeeze(-1)
            outside = (target < kept.floor) | ((target == kept.floor) & (targets < kept.first))
            return Kept(torch.minimum(kept.floor, target), kept.first.masked_fill(outside, 0)), outside

    def mask(
        self, x: torch.Tensor, targets: torch.Tensor, search: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` with every value outside its row's kept set set to ``-inf`` (differentiable in the kept
        values), and ``outside`` (:meth:`kept`). The kept set is searched in ``search`` (default: ``x``'s
        dtype)."""
        s = x.detach() if search is None else x.detach().to(search)
        kept, outside = self.kept(s, targets)
        return x.masked_fill(kept.drops(s), float("-inf")), outside


def kept_entropy(logp: torch.Tensor) -> torch.Tensor:
    """``-sum p log p`` over the last dimension, where ``-inf`` entries (truncated away) count 0."""
    with torch.no_grad():
        return -torch.where(torch.isfinite(logp), logp.exp() * logp, 0.0).sum(-1)
