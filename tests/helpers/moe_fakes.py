"""PyTorch stand-ins for vLLM's two MoE kernels (GPU-only), computing the same math, for the CPU tests of
``asyncrl.models.vllm_moe`` and the bitwise forward."""

from __future__ import annotations

import torch

from asyncrl.models import vllm_moe


def topk_softmax(weights, ids, _token_expert, logits, renormalize):
    """``_moe_C.topk_softmax``'s contract (fills ``weights`` and ``ids`` in place)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(probs, weights.shape[1], dim=-1)
    weights.copy_(top / top.sum(-1, keepdim=True) if renormalize else top)
    ids.copy_(idx)


def fused_experts(x, w13, w2, weights, ids):
    """``fused_moe.fused_experts`` for unquantized weights: int32 ids, fp32 weights, as vLLM's router hands
    them."""
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32, (ids.dtype, weights.dtype)
    return vllm_moe.experts_reference(x, w13, w2, weights, ids)
