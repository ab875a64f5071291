"""Per-row sampling with processed logprobs (pure functions).

Each row has its own temperature, top-p and ``torch.Generator``: a seeded request draws the same tokens
whatever else shares its batch. The returned logprob is that of the distribution actually sampled from
(after temperature and top-p renormalisation), which is what the trainer's importance ratio needs.
Temperature 0 means greedy, and its logprobs are the raw (temperature 1) ones, as in vLLM.
"""

from __future__ import annotations

import torch


def processed_logprobs(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Log-probabilities ``[rows, vocab]`` after temperature scaling and nucleus (top-p) truncation.

    Computed in float64: CPU softmax kernels round a row differently depending on its position in the
    batch (~5e-7 in float32); in float64 that difference disappears when results are rounded to float32.
    """
    logits = logits.double()
    greedy = temperatures <= 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures).double()
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    if bool((top_ps < 1).any()):
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        cum = sorted_logp.exp().cumsum(-1)
        # keep a token if the mass before it is < top_p (the most likely token is always kept)
        drop_sorted = (cum - sorted_logp.exp()) >= top_ps[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        drop &= (top_ps < 1)[:, None] & ~greedy[:, None]
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def sample_tokens(
    logp: torch.Tensor, temperatures: torch.Tensor, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverse-CDF sampling with the row's own generator.

    Returns ``(tokens [rows], logprobs [rows])``; greedy rows (temperature 0) take the argmax.
    """
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(logp.device, logp.dtype)
    probs = logp.exp()
    cdf = probs.cumsum(-1)
    # right=True skips zero-probability tokens (flat CDF steps) that top-p removed
    sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=logp.shape[-1] - 1)
    tokens = torch.where(temperatures <= 0, logp.argmax(-1), sampled)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1).float()


def row_generator(seed: int, choice: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The generator of choice ``choice`` of a request seeded with ``seed``."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + choice) % (2**63 - 1))
    return g
