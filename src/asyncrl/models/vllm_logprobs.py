"""Token logprobs as vLLM's samplers compute them (V2's, and V1's for a mixture of experts), with a
backward pass: what ``numerics=bitwise`` trains on (:mod:`asyncrl.models.bitwise`)."""

from __future__ import annotations

import torch

from asyncrl.models import vllm_kernels
from asyncrl.models.logprobs import token_entropy
from asyncrl.models.truncation import Truncation, kept_entropy
from asyncrl.models.vllm_kernels import _vllm_layout


def _processed(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The sampler's processed logits: divided by the temperature in place, in their own dtype (a no-op at
    1)."""
    if bool(((temperatures == 0) | (temperatures == 1)).all()):
        return _vllm_layout(logits)
    # a copy in vLLM's layout (clone alone would pack the rows)
    logits = _vllm_layout(logits.detach().clone())
    rows = torch.arange(len(logits), device=logits.device, dtype=torch.int32)
    vllm_kernels._vllm().apply_temperature(logits, rows, temperatures.float().contiguous())
    return logits


def _row_chunk(vocab: int) -> int:
    """Rows of ``vocab`` fp32 values in ~256 MiB: the chunks that keep a whole fp32 ``[N, V]`` tensor
    unmade."""
    return max(1, (1 << 28) // (4 * vocab))


def _logprob_grad(
    processed_rows, targets: torch.Tensor, t: torch.Tensor, g: torch.Tensor, out: torch.Tensor
):
    """``out`` <- the gradient of ``log softmax(logits / t)[target]`` per row, scaled by ``g``, from
    ``processed_rows(s, e)`` (rows ``s:e`` of the processed logits, fp32), in chunks of rows
    (:func:`_row_chunk`)."""
    chunk = _row_chunk(out.shape[1])
    for s in range(0, len(out), chunk):
        p = torch.softmax(processed_rows(s, s + chunk), dim=-1)
        p.neg_()
        p[torch.arange(len(p), device=p.device), targets[s : s + chunk]] += 1.0
        out[s : s + chunk] = (p * (g[s : s + chunk] / t[s : s + chunk])[:, None]).to(out.dtype)
    return out


class _TokenLogprobs(torch.autograd.Function):
    """``log softmax(logits / T)[target]`` per row as vLLM's V2 model runner computes it: the temperature
    applied to the logits in their own dtype, then its Triton kernel (max, log-sum-exp and the target's value
    in fp32)."""

    @staticmethod
    def forward(ctx, logits, targets, temperatures):
        processed = _processed(logits, temperatures)
        ctx.save_for_backward(processed, targets, temperatures)
        return vllm_kernels._vllm().compute_token_logprobs(processed, targets[:, None]).squeeze(1)

    @staticmethod
    def backward(ctx, g):
        processed, targets, temperatures = ctx.saved_tensors
        t = temperatures.float()
        t = torch.where(t == 0, torch.ones_like(t), t)  # temperature 0 rows are greedy: no scaling
        rows = lambda s, e: processed[s:e].float()  # noqa: E731
        return _logprob_grad(rows, targets, t, g, torch.empty_like(processed)), None, None


def _v1_temperatures(temperatures: torch.Tensor) -> torch.Tensor:
    """The V1 sampler's divisors: the temperature in fp32, 1 for greedy rows (under vLLM's
    ``_SAMPLING_EPS``)."""
    t = temperatures.float()
    return torch.where(t < 1e-5, torch.ones_like(t), t)


class _TokenLogprobsV1(torch.autograd.Function):
    """``log softmax(logits / T)[target]`` per row as vLLM's V1 model runner computes it (the runner vLLM
    0.26 gives a mixture of experts: :func:`asyncrl.models.bitwise.sampler_runner`): the logits upcast to
    fp32, divided by the temperature in fp32, vLLM's batch-invariant ``log_softmax`` (one program per row, so
    chunks of rows give the same bits), the target's value."""

    @staticmethod
    def forward(ctx, logits, targets, temperatures):
        t = _v1_temperatures(temperatures)
        out = torch.empty(len(logits), dtype=torch.float32, device=logits.device)
        chunk = _row_chunk(logits.shape[1])
        for s in range(0, len(logits), chunk):
            x = logits[s : s + chunk].float() / t[s : s + chunk, None]
            out[s : s + chunk] = (
                vllm_kernels._vllm()
                .log_softmax(x, dim=-1)
                .gather(-1, targets[s : s + chunk, None])
                .squeeze(1)
            )
        ctx.save_for_backward(logits, targets, t)
        return out

    @staticmethod
    def backward(ctx, g):
        logits, targets, t = ctx.saved_tensors
        rows = lambda s, e: logits[s:e].float() / t[s:e, None]  # noqa: E731
        return _logprob_grad(rows, targets, t, g, torch.empty_like(logits)), None, None


# vLLM's model runners, by the name :func:`asyncrl.models.bitwise.sampler_runner` gives them: how each turns
# a row of logits into the logits its top-k / top-p search (the processed ones, fp32) and its logprob see
SAMPLERS = {
    "v2": (lambda flat, temps: _processed(flat, temps).float(), _TokenLogprobs),
    "v1": (lambda flat, temps: flat.float() / _v1_temperatures(temps)[:, None], _TokenLogprobsV1),
}


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperatures: torch.Tensor,
    entropy_out: list | None = None,
    truncation: Truncation | None = None,
    runner: str = "v2",
) -> torch.Tensor:
    """Drop-in for :func:`asyncrl.models.logprobs.compute_logprobs` (same shapes and meaning) with the
    logprobs vLLM's sampler returns for ``processed_logprobs`` in its model runner ``runner``
    (:data:`SAMPLERS`): logits at ``i-1`` score token ``i``. With ``truncation``, the values outside each
    row's kept set (searched in the processed logits' fp32, as the sampler searches) are ``-inf`` before the
    sampler's kernel runs, as vLLM's min-p and top-k/top-p mask them."""
    processed_fp32, kernel = SAMPLERS[runner]
    if runner == "v1" and truncation is not None and bool((truncation.min_p > 0).any()):
        # V1 drops a token whose probability is under min_p times the largest; the kept set mirrors V2's test
        # on the logits (the same rule in exact arithmetic, not in fp32 at the edge)
        raise ValueError("numerics=bitwise: min_p on a model vLLM serves with its V1 runner (a mixture of "
                         "experts) is not reproduced; use top_k / top_p, or numerics=fast")  # fmt: skip
    b, length, vocab = logits.shape
    # every position is scored (the last one against a dummy target, then dropped) so the rows stay a view of
    # the forward's padded logits, in vLLM's layout, instead of a packed copy
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    temps = torch.cat([temperatures[:, 1:], torch.ones_like(temperatures[:, :1])], dim=1)
    flat = logits.flatten(0, 1)
    if truncation is not None:
        cut = truncation.shifted()
        # the dummy last position keeps the whole distribution (top_k 0, top_p 1, min_p 0)
        settings = [
            torch.cat([v, torch.full_like(v[:, :1], off)], dim=1).reshape(-1)
            for v, off in ((cut.top_k, 0), (cut.top_p, 1.0), (cut.min_p, 0.0))
        ]
        processed = processed_fp32(flat.detach(), temps.reshape(-1))
        kept, outside = Truncation(*settings).kept(processed, targets.reshape(-1))
        truncation.outside = outside.view(b, length)[:, :-1]
        flat = _vllm_layout(flat.masked_fill(kept.drops(processed), float("-inf")))
        del processed
    out = kernel.apply(flat, targets.reshape(-1), temps.reshape(-1))
    if entropy_out is not None:
        with torch.no_grad():
            scored = logits if truncation is None else flat.reshape(b, length, vocab)
            logp = torch.log_softmax(scored[:, :-1].float() / temperatures[:, 1:, None], dim=-1)
            entropy_out.append(token_entropy(logp) if truncation is None else kept_entropy(logp))
    return out.view(b, length)[:, :-1]
