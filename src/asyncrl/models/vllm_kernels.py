"""vLLM's batch-invariant kernels as differentiable torch functions, for the ``numerics=bitwise`` forward
(:mod:`asyncrl.models.bitwise`, which says which vLLM layer calls which kernel).

Each kernel is forward-only: it is wrapped in an autograd function whose backward differentiates a PyTorch
expression of the same math (:class:`_Kernel`), or, for the matmuls and the logprob, an explicit backward.
The forward values are vLLM's bit for bit; the gradient is the exact gradient of the reference expression,
which differs from the kernels' only by rounding.

vLLM is imported inside :func:`enable` and :func:`_vllm` only: it is a GPU-only dependency, absent on the
CPU, and some of its modules read ``VLLM_BATCH_INVARIANT`` when first imported, so they must load after
:func:`enable`.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.models.attention import packed_attention

BLOCK_SIZE = 16  # vLLM's KV-cache block size on CUDA; the paged copy below uses the same
# vLLM pads the vocabulary (embedding and lm_head rows) to a multiple of 64 and hands the sampler the first
# ``vocab`` columns of the padded logits: a view whose row stride is the padded width. Triton specialises a
# kernel on its integer arguments' divisibility by 16, and the logprob kernel's reduction order follows from
# that: with another row stride (a 103-token vocabulary) some logprobs differ by one ulp, so the trainer's
# logits have vLLM's layout too (`python benchmarks/bitwise_probe.py --help` compares the two sides on a
# GPU).
VOCAB_PADDING = 64


def padded_vocab(vocab: int) -> int:
    """The row stride of vLLM's logits for a ``vocab``-token model
    (``vocab_parallel_embedding.pad_vocab_size``)."""
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def _vllm_layout(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[N, V]`` as vLLM holds them: a view of the first ``V`` columns of
    ``[N, padded_vocab(V)]`` (``logits`` itself when it is already laid out so; otherwise a copy)."""
    n, vocab = logits.shape
    if logits.stride() == (padded_vocab(vocab), 1):
        return logits
    buf = logits.new_empty(n, padded_vocab(vocab))
    buf[:, :vocab] = logits
    return buf[:, :vocab]


def enable() -> None:
    """Batch-invariant mode for this process, as vLLM sets it for its own (call before CUDA is
    initialised)."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

    init_batch_invariance()


@functools.cache
def _vllm() -> types.SimpleNamespace:
    """vLLM's kernels, imported once (after :func:`enable`: some modules read the flag at import)."""
    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        raise RuntimeError(
            "numerics=bitwise: call asyncrl.models.bitwise.enable() first "
            "(VLLM_BATCH_INVARIANT=1 before vLLM loads)"
        )
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import batch_invariant as bi
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    return types.SimpleNamespace(
        fused_add_rms_norm=ops.fused_add_rms_norm,
        rotary_embedding=ops.rotary_embedding,
        silu_and_mul=torch.ops._C.silu_and_mul,
        matmul=bi.matmul_persistent,
        rms_norm=bi.rms_norm_batch_invariant,
        RotaryEmbedding=RotaryEmbedding,
        unified_attention=unified_attention,
        apply_temperature=apply_temperature,
        compute_token_logprobs=compute_token_logprobs,
        log_softmax=bi.log_softmax,
    )


# --- kernels with a reference backward ---------------------------------------------------------------------


class _Kernel(torch.autograd.Function):
    """``kernel(*tensors)`` forward; backward through ``reference(*tensors)`` (same math, differentiable)."""

    @staticmethod
    def forward(ctx, kernel, reference, *tensors):
        ctx.reference = reference
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return kernel(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        need = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, need, strict=False)]
            outs = ctx.reference(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grads, strict=False) if g is not None and o.requires_grad]
            wanted = [t for t, n in zip(inputs, need, strict=False) if n]
            found: Any = iter([None] * len(wanted))
            if pairs and wanted:
                outs, grads = zip(*pairs, strict=False)
                found = iter(torch.autograd.grad(outs, wanted, grads, allow_unused=True))
        return (None, None, *(next(found) if n else None for n in need))


def _apply(kernel, reference, *tensors):
    return _Kernel.apply(kernel, reference, *tensors)


class _Linear(torch.autograd.Function):
    """``x @ w.T`` through vLLM's persistent Triton matmul; the backward's two matmuls are ordinary ones."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _vllm().matmul(x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = (g2 @ w).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = g2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = _Linear.apply(x, w)
    # vLLM's linear_batch_invariant adds the bias after the matmul
    return out + bias if bias is not None else out


def rms_reference(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _apply(lambda a, b: _vllm().rms_norm(a, b, eps), lambda a, b: rms_reference(a, b, eps), x, w)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> None:
    """Batch-invariant stand-in for vLLM's ``_custom_ops.fused_add_rms_norm`` (same in-place contract:
    ``residual <- x + residual``, ``x <- RMSNorm(residual)``), installed in vLLM by
    :mod:`asyncrl.inference.vllm.plugin` under ``numerics=bitwise``.

    vLLM 0.26's batch-invariant RMSNorm hands the residual case to that CUDA kernel, which launches 1,024
    threads a row below 256 tokens and 256 from there on (measured: ``benchmarks/bitwise_probe.py --ops``),
    so a row's bits depended on how many tokens shared its step. An elementwise add and the Triton
    ``rms_norm_batch_invariant`` (one program a row) give every row the same bits at any batch size, so vLLM
    keeps its own step sizes and CUDA graphs, and the trainer computes the same."""
    residual.add_(x)
    x.copy_(_vllm().rms_norm(residual, weight, eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    """vLLM's ``RMSNorm(x, residual)`` under the plugin: ``(norm(x + residual), x + residual)``."""

    def kernel(a, r, b):
        a, r = a.contiguous().clone(), r.contiguous().clone()
        fused_add_rms_norm(a.view(-1, a.shape[-1]), r.view(-1, r.shape[-1]), b, eps)
        return a, r

    def reference(a, r, b):
        z = a + r
        return rms_reference(z, b, eps), z

    return _apply(kernel, reference, x, residual, w)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2

    def kernel(a):
        out = torch.empty(*a.shape[:-1], d, dtype=a.dtype, device=a.device)
        _vllm().silu_and_mul(out, a.contiguous())
        return out

    return _apply(kernel, lambda a: (F.silu(a[..., :d].float()) * a[..., d:].float()).to(a.dtype), x)


def rope_reference(
    positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor, head_size: int
) -> torch.Tensor:
    """NeoX RoPE of ``x`` ``[T, H*D]`` in fp32 from a ``cat(cos, sin)`` cache: the kernel's math,
    differentiable."""
    cos, sin = cache[positions].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    y = x.float().view(x.shape[0], -1, head_size)
    y1, y2 = y.chunk(2, dim=-1)
    return torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1).flatten(1).to(x.dtype)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor, head_size: int):
    """NeoX-style RoPE of ``q`` ``[T, Hq*D]`` and ``k`` ``[T, Hkv*D]`` with vLLM's kernel and cos/sin
    cache."""

    def kernel(p, a, b, c):
        a, b = a.contiguous().clone(), b.contiguous().clone()
        _vllm().rotary_embedding(p, a, b, head_size, c, True)
        return a, b

    def reference(p, a, b, c):
        return rope_reference(p, a, c, head_size), rope_reference(p, b, c, head_size)

    return _apply(kernel, reference, positions, q, k, cache)


@functools.cache
def rope_cache(head_size: int, theta: float, max_position: int, device: str) -> torch.Tensor:
    """vLLM's ``RotaryEmbedding`` cos/sin cache (its own code, on the GPU as vLLM builds it), in bf16.

    Built with autocast off whatever the caller's context: under the trainer's bf16 autocast its ``einsum``
    runs as a bf16 matmul on CUDA, and every logprob moves off vLLM's
    (``python benchmarks/bitwise_probe.py --help``)."""
    rope = types.SimpleNamespace(rotary_dim=head_size, base=theta, max_position_embeddings=max_position)
    cls = _vllm().RotaryEmbedding
    rope._compute_inv_freq = functools.partial(cls._compute_inv_freq, rope)
    with torch.device(device), torch.autocast(torch.device(device).type, enabled=False):
        return cls._compute_cos_sin_cache(rope).to(torch.bfloat16)


class PackedAttention:
    """Where each token of a packed stream sits in a paged KV cache of ``BLOCK_SIZE`` blocks, built once per
    forward pass and shared by the layers: sample ``i`` (positions restarting at 0) gets its own blocks."""

    def __init__(self, cu_seqlens: torch.Tensor, max_len: int):
        self.cu, self.max_len = cu_seqlens, max_len
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        blocks = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
        first = torch.cumsum(blocks, 0) - blocks
        self.num_blocks = int(blocks.sum())
        seq = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
        within = torch.arange(int(cu_seqlens[-1]), device=lens.device) - cu_seqlens[seq].long()
        self.slots = first[seq].long() * BLOCK_SIZE + within
        width = (max_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        self.block_table = (first[:, None] + torch.arange(width, device=lens.device)[None, :]).to(
            torch.int32
        )
        self.seq_lens = lens.to(torch.int32)

    def paged(self, x: torch.Tensor) -> torch.Tensor:
        cache = x.new_zeros(self.num_blocks * BLOCK_SIZE, *x.shape[1:])
        cache[self.slots] = x
        return cache.view(self.num_blocks, BLOCK_SIZE, *x.shape[1:])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of ``q`` ``[T, Hq, D]`` over ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq*D]``."""

        def kernel(q, k, v):
            out = torch.empty_like(q)
            ones = torch.ones(1, dtype=torch.float32, device=q.device).expand(len(self.seq_lens), k.shape[1])
            _vllm().unified_attention(
                q=q.contiguous(), k=self.paged(k), v=self.paged(v), out=out,
                cu_seqlens_q=self.cu, max_seqlen_q=self.max_len, seqused_k=self.seq_lens,
                max_seqlen_k=self.max_len, softmax_scale=scale, causal=True, window_size=(-1, -1),
                block_table=self.block_table, softcap=0, q_descale=None, k_descale=ones, v_descale=ones,
            )  # fmt: skip
            return out

        def reference(q, k, v):
            return packed_attention(q, k, v, self.cu, self.max_len, scale)

        return _apply(kernel, reference, q, k, v).flatten(1)


# --- the sampled token's logprob ---------------------------------------------------------------------------
