"""Token logprobs from a model's logits: the math the trainer's loss and the built-in inference engine share,
so that both score a sampled token the same way (temperature, then the sampler's truncation when it had one,
then log-softmax, then the token's entry)."""

from __future__ import annotations

import torch

from asyncrl.models.truncation import Kept, Truncation, kept_entropy


def compute_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperatures: torch.Tensor,
    entropy_out: list | None = None,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """Logprob of each token ``input_ids[:, i]`` given the prefix, for ``i >= 1``: shape ``[B, T-1]``.

    Logits at position ``i-1`` predict token ``i`` and are divided by the temperature token ``i`` was sampled
    at, matching the sidecar's processed logprobs. With ``truncation`` (aligned with ``input_ids``) each
    token is scored under the top-k / top-p / min-p distribution it was sampled from, renormalised; its kept
    set is searched in float64, as the built-in engine's is. With ``entropy_out`` the entropy of each of
    those distributions (``[B, T-1]``, no gradient) is appended to it too.
    """
    logits = logits[:, :-1].float() / temperatures[:, 1:, None]
    if truncation is not None:
        logits, truncation.outside = truncation.shifted().mask(logits, input_ids[:, 1:], torch.float64)
    logp = torch.log_softmax(logits, dim=-1)
    if entropy_out is not None:
        entropy_out.append(token_entropy(logp.detach()) if truncation is None else kept_entropy(logp))
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


class _SampledLogprob(torch.autograd.Function):
    """:func:`compute_logprobs` without its ``[T, vocab]`` fp32 intermediates, for ``torch.compile`` to fuse
    (``asyncrl.trainer.forward.compiled_logprobs``): forward ``x[id] - logsumexp(x)`` with
    ``x = logits / T``, one reduction over the logits; backward ``g (onehot(id) - softmax(x)) / T`` in one
    elementwise pass, where autograd's own would scatter the gather's gradient into a zero fp32 tensor of the
    logits' size first."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
        x = logits.float() / temps[..., None]
        lse = torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(logits, ids, temps, lse)
        return x.gather(-1, ids[..., None]).squeeze(-1) - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, ids, temps, lse = ctx.saved_tensors
        x = logits.float() / temps[..., None]
        onehot = torch.arange(x.shape[-1], device=x.device) == ids[..., None]
        grad_x = grad[..., None] * (onehot.float() - torch.exp(x - lse[..., None]))
        return (grad_x / temps[..., None]).to(logits.dtype), None, None


def sampled_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperatures: torch.Tensor
) -> torch.Tensor:
    """:func:`compute_logprobs` (no entropies) through :class:`_SampledLogprob`: the same function, written
    for a compiler to fuse; uncompiled it is no faster."""
    return _SampledLogprob.apply(logits[:, :-1], input_ids[:, 1:], temperatures[:, 1:])


def token_entropy(logp: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``-sum p log p`` over the vocabulary for each position of ``logp`` ``[B, T, V]``, in chunks of
    positions: ``exp(logp)`` of a whole packed row would be another ``[T, V]`` fp32 tensor (GBs for a large
    vocabulary)."""
    with torch.no_grad():
        parts = [-(c.exp() * c).sum(-1) for c in logp.split(chunk, dim=1)]
        return torch.cat(parts, dim=1) if parts else logp.new_zeros(logp.shape[:2])


# positions per chunk of the chunked head: its transient fp32 tensors are [chunk, vocab], ~0.6 GB each at
# Qwen3's 151,936 ids, against ~10 GB for a whole 16k-token row
CHUNK = 1024


class _ChunkedLogprob(torch.autograd.Function):
    """:func:`compute_logprobs` a chunk of positions at a time, forward and backward: no ``[T, vocab]`` fp32
    tensor ever exists (the eager formula keeps three: the upcast, the scaled logits and the log-softmax it
    saves for backward). Saves the logits in their own dtype and one fp32 log-sum-exp per position (and,
    truncated, its kept set: the smallest kept value and the first index kept among ties with it); the
    backward recomputes each chunk's softmax and writes its gradient straight into the logits' dtype. The
    backward's formula is the one autograd uses for log-softmax then gather
    (``g at the id, minus softmax x g``), so the two agree to rounding."""

    @staticmethod
    def forward(ctx, logits, ids, temps, entropies: list | None, truncation: Truncation | None = None):
        out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if entropies is not None else None
        floors = torch.empty_like(out) if truncation is not None else None
        firsts = (
            torch.empty(ids.shape, dtype=torch.long, device=ids.device) if truncation is not None else None
        )
        outside = (
            torch.empty(ids.shape, dtype=torch.bool, device=ids.device) if truncation is not None else None
        )
        for s in range(0, ids.shape[1], CHUNK):
            at = slice(s, s + CHUNK)
            x = logits[:, at].float() / temps[:, at, None]
            if truncation is not None and floors is not None and firsts is not None and outside is not None:
                (floors[:, at], firsts[:, at]), outside[:, at] = truncation.sliced(at).kept(x, ids[:, at])
                x = x.masked_fill(Kept(floors[:, at], firsts[:, at]).drops(x), float("-inf"))
            lse[:, at] = torch.logsumexp(x, dim=-1)
            logp = x - lse[:, at, None]
            out[:, at] = logp.gather(-1, ids[:, at, None]).squeeze(-1)
            if entropy is not None:
                entropy[:, at] = -(logp.exp() * logp).sum(-1) if truncation is None else kept_entropy(logp)
        if entropies is not None:
            entropies.append(entropy)
        if truncation is not None:
            truncation.outside = outside
        ctx.save_for_backward(logits, ids, temps, lse, *([floors, firsts] if truncation is not None else []))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, ids, temps, lse, *kept = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for s in range(0, ids.shape[1], CHUNK):
            t = temps[:, s : s + CHUNK, None]
            g = grad[:, s : s + CHUNK, None]
            x = logits[:, s : s + CHUNK].float() / t
            # the values outside the kept set are out of the distribution: probability 0, gradient 0
            if kept:
                x = x.masked_fill(Kept(*(k[:, s : s + CHUNK] for k in kept)).drops(x), float("-inf"))
            p = torch.exp(x - lse[:, s : s + CHUNK, None])
            gx = torch.zeros_like(p).scatter_(-1, ids[:, s : s + CHUNK, None], g) - p * g
            grad_logits[:, s : s + CHUNK] = (gx / t).to(logits.dtype)
        return grad_logits, None, None, None, None


def chunked_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperatures: torch.Tensor,
    entropy_out: list | None = None,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """:func:`compute_logprobs` (same arguments and result, entropies and truncation included) in chunks of
    :data:`CHUNK` positions (:class:`_ChunkedLogprob`): what the trainer uses on GPUs, where a long row's
    ``[T, vocab]`` fp32 tensors are GBs; a truncated kept set is searched in fp32, as vLLM's sampler does.
    The CPU keeps :func:`compute_logprobs`, whose roundings the reproducible runs' recorded results hold."""
    shifted = truncation.shifted() if truncation is not None else None
    out = chunked_token_logprobs(logits[:, :-1], input_ids[:, 1:], temperatures[:, 1:], entropy_out, shifted)
    if truncation is not None and shifted is not None:
        truncation.outside = shifted.outside
    return out


def chunked_token_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    temperatures: torch.Tensor,
    entropy_out: list | None = None,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """The logprob of ``target_ids[:, i]`` under ``logits[:, i] / temperatures[:, i]`` (all aligned,
    ``[B, T]``, ``truncation`` too), chunked as :func:`chunked_logprobs`; with ``entropy_out``, each
    distribution's entropy is appended to it."""
    entropies: list | None = [] if entropy_out is not None else None
    out = _ChunkedLogprob.apply(logits, target_ids, temperatures, entropies, truncation)
    if entropy_out is not None and entropies:
        entropy_out.append(entropies[0])
    return out
