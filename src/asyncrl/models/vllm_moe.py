"""vLLM's mixture-of-experts kernels as differentiable functions, for the ``numerics=bitwise`` forward of a
Qwen3-MoE (:mod:`asyncrl.models.bitwise`).

vLLM 0.26 runs an unquantized MoE layer as: the router's logits from the gate (a linear layer,
batch-invariant like every other), ``_moe_C.topk_softmax`` (softmax, top-k, renormalised when the model says
so; fp32 weights, one row per token), then the Triton fused-experts kernels (``fused_moe.fused_experts``:
gate/up GEMM, SiLU * up, down GEMM scaled by each route's weight, ``moe_sum`` over the top-k). With
``VLLM_BATCH_INVARIANT=1`` the Triton kernels take one fixed tile configuration (``get_default_config``: 64 x
64 x 32, no split-K) whatever the batch, so a token's row does not depend on what else is in the batch, and
the trainer calls the same functions here.

As in :mod:`asyncrl.models.vllm_kernels`, each kernel's gradient is that of a PyTorch expression of the same
math: :func:`routing_weights` (the router learns through the softmax of the experts it picked) and
:func:`experts_reference` (transformers' per-expert loop).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from asyncrl.models.vllm_kernels import _apply, _vllm


@functools.cache
def _moe() -> tuple:
    """vLLM's ``topk_softmax`` and ``fused_experts`` (after :func:`asyncrl.models.vllm_kernels.enable`)."""
    _vllm()  # refuses before enable(): the fused-MoE module reads VLLM_BATCH_INVARIANT
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    return ops.topk_softmax, fused_experts


def routing_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The fp32 weights of the experts ``ids`` ``[T, k]``: their softmax probabilities under ``logits``
    ``[T, E]``, renormalised over the ``k`` when ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``)."""
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, ids.long())
    return probs / probs.sum(dim=-1, keepdim=True) if renormalize else probs


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's routing of each token: ``(weights, ids)``, ``[T, top_k]`` fp32 and int32, in the kernel's
    order."""
    topk_softmax, _ = _moe()
    tokens = logits.shape[0]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    with torch.no_grad():
        topk_softmax(weights, ids, torch.empty_like(ids), logits.detach().contiguous(), renormalize)
    reference = functools.partial(routing_weights, renormalize=renormalize)
    return _apply(lambda _logits, _ids: weights, reference, logits, ids), ids


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The experts' output ``[T, H]``: for each token and each of its experts ``e``, ``w2[e] (silu(g) * u)``
    with ``g, u`` the halves of ``w13[e] x``, scaled by the route's weight and summed (in fp32, then ``x``'s
    dtype)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out = out.index_add(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """vLLM's fused experts on ``x`` ``[T, H]`` (bf16), ``w13`` ``[E, 2I, H]`` (each expert's gate rows, then
    its up rows: transformers' ``gate_up_proj`` and vLLM's ``w13_weight``), ``w2`` ``[E, H, I]``, ``weights``
    fp32 and ``ids`` ``[T, top_k]``."""
    _, fused_experts = _moe()
    ids = ids.to(torch.int32)

    def kernel(x, w13, w2, weights, ids):
        return fused_experts(x.contiguous(), w13, w2, weights, ids)

    return _apply(kernel, experts_reference, x, w13, w2, weights, ids)
