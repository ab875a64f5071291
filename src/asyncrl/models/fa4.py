"""flash-attn-4's varlen kernels as torch custom ops, so a ``torch.compile``'d decoder layer stays one graph.

``attn_implementation="varlen_fa4"`` (models/attention.py) runs packed-row attention on flash-attn-4's CuTe
DSL kernels (Hopper, Blackwell): 1.62x torch's varlen kernel, forward and backward, on an H200
(benchmarks/results/README.md). transformers' ``flash_attention_4`` path calls ``flash_attn.cute``'s
``FlashAttnVarlenFunc``, a plain ``autograd.Function`` whose body (kernel cache lookups, CuTe compilation)
dynamo cannot trace, so each compiled layer splits around it. Here the forward and backward kernels are
opaque ``torch.library`` ops with fake (shape-only) implementations and a registered backward: the compiler
sees one op per direction, the layer one graph, and the ops' Python runs only when they launch.

Only what the trainer uses: causal, no softcap, no window, no sinks; key/value heads may be fewer than query
heads (flash-attn-4 handles grouped-query attention itself). The lse output is the kernel's
``[heads, tokens]`` fp32 log-sum-exp, saved for the backward and not differentiable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NEEDS = (
    "model.attn_implementation=varlen_fa4 needs flash-attn-4 (`pip install flash-attn-4`, "
    "Hopper or newer GPU)"
)


def kernels() -> tuple[Callable, Callable]:
    """flash-attn-4's forward and backward entry points (``flash_attn.cute.interface``): tests replace
    this."""
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except ImportError as e:
        raise RuntimeError(f"{NEEDS}: {e}") from e
    return _flash_attn_fwd, _flash_attn_bwd


def check_installed() -> None:
    """Fail at model load, with the config key, rather than at the first forward."""
    kernels()


@torch.library.custom_op("asyncrl::fa4_varlen_fwd", mutates_args=())
def varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a packed stream: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, boundaries ``cu`` (int32,
    ``[samples + 1]``) -> (out ``[T, Hq, D]``, lse ``[Hq, T]`` fp32)."""
    fwd, _ = kernels()
    out, lse, *_ = fwd(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
        softmax_scale=scale, causal=True, return_lse=True,
    )  # fmt: skip
    return out, lse


@varlen_fwd.register_fake
def _(q, k, v, cu, max_len, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("asyncrl::fa4_varlen_bwd", mutates_args=())
def varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v for :func:`varlen_fwd`'s output gradient ``dout``."""
    _, bwd = kernels()
    dq, dk, dv, *_ = bwd(
        q, k, v, out, dout.contiguous(), lse, scale, True,
        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
    )  # fmt: skip
    return dq, dk, dv


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu, max_len, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu, max_len, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu)
    ctx.max_len, ctx.scale = max_len, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu = ctx.saved_tensors
    dq, dk, dv = varlen_bwd(dout, q, k, v, out, lse, cu, ctx.max_len, ctx.scale)
    return dq, dk, dv, None, None, None


varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def packed_attention_fa4(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`asyncrl.models.attention.packed_attention`'s contract on flash-attn-4 (default scale
    1/sqrt(D))."""
    return varlen_fwd(q, k, v, cu, max_len, q.shape[-1] ** -0.5 if scale is None else float(scale))[0]
