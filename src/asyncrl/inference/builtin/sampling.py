"""Per-row sampling with processed logprobs (pure functions).

Each row has its own temperature, top-k, top-p, min-p and ``torch.Generator``: a seeded request draws the
same tokens whatever else shares its batch. The returned logprob is that of the distribution actually sampled
from (after temperature and truncation, renormalised), which is what the trainer's importance ratio needs.
Temperature 0 means greedy, and its logprobs are the raw (temperature 1) ones, as in vLLM.
"""

from __future__ import annotations

import torch

from asyncrl.models.truncation import kept_set


def processed_logprobs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    top_ks: torch.Tensor | None = None,
    min_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities ``[rows, vocab]`` after temperature scaling and truncation (min-p, top-k, top-p in
    vLLM's order: :func:`asyncrl.models.truncation.kept_set`, the rule the trainer scores with),
    renormalised.

    Computed in float64: CPU softmax kernels round a row differently depending on its position in the
    batch (~5e-7 in float32); in float64 that difference disappears when results are rounded to float32.
    """
    logits = logits.double()
    greedy = temperatures <= 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures).double()
    x = logits / scale[:, None]
    logp = torch.log_softmax(x, dim=-1)
    top_ks = torch.zeros_like(top_ps, dtype=torch.long) if top_ks is None else top_ks
    min_ps = torch.zeros_like(top_ps) if min_ps is None else min_ps
    if bool(((top_ps < 1) | (top_ks > 0) | (min_ps > 0)).any()):
        sampled = ~greedy  # greedy rows take the argmax of the whole distribution
        kept = kept_set(
            x,
            torch.where(sampled, top_ks, 0),
            torch.where(sampled, top_ps, 1.0),
            torch.where(sampled, min_ps, 0.0),
        )
        logp = torch.log_softmax(x.masked_fill(kept.drops(x), float("-inf")), dim=-1)
    return logp


def sample_tokens(
    logp: torch.Tensor, temperatures: torch.Tensor, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverse-CDF sampling with the row's own generator.

    Returns ``(tokens [rows], logprobs [rows])``; greedy rows (temperature 0) take the argmax.
    """
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(
        logp.device, logp.dtype
    )
    probs = logp.exp()
    cdf = probs.cumsum(-1)
    # right=True skips zero-probability tokens (flat CDF steps) that truncation removed
    sampled = (
        torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
        .squeeze(-1)
        .clamp(max=logp.shape[-1] - 1)
    )
    tokens = torch.where(temperatures <= 0, logp.argmax(-1), sampled)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1).float()


def row_generator(seed: int, choice: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The generator of choice ``choice`` of a request seeded with ``seed``."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + choice) % (2**63 - 1))
    return g
