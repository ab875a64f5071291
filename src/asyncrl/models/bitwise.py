"""``numerics=bitwise`` on GPU: the trainer's forward built from the kernels vLLM runs in batch-invariant mode.

vLLM with ``VLLM_BATCH_INVARIANT=1``, its eager ops (CUDA graphs replay them; Inductor would fuse them
differently), the Triton attention backend and asyncrl's vLLM plugin
(:func:`fused_add_rms_norm` in place of vLLM's CUDA kernel, see below) computes every row of a batch the same
whatever else is in the batch, and a decode step computes a token's row as a prefill would (measured on an H100:
``benchmarks/bitwise_probe.py``).
This module makes the trainer compute that same row: a Llama/Qwen2/Qwen3 forward pass (the HF model's own
parameters, laid out as vLLM lays them: q/k/v and gate/up projections concatenated) that calls, op for op and in
vLLM's order, the functions vLLM's layers call:

================================  =========================================================================
vLLM layer (batch-invariant)       kernel, called here too
================================  =========================================================================
linear layers, ``lm_head``         ``batch_invariant.matmul_persistent`` (Triton, fixed tiles, no split-K)
first ``input_layernorm``,         ``batch_invariant.rms_norm_batch_invariant`` (Triton, one program a row)
q/k norms (Qwen3)
residual add + RMSNorm             :func:`fused_add_rms_norm`: an add, then the Triton RMSNorm (asyncrl's plugin
                                   puts it in vLLM, whose CUDA kernel is not batch-invariant)
RoPE                               ``_C.rotary_embedding`` on vLLM's own cos/sin cache
attention                          ``triton_unified_attention.unified_attention`` (2-D kernel), on a paged
                                   copy of the packed rows' keys and values
SiLU * up                          ``_C.silu_and_mul``
sampled token's logprob            the model runner's ``_temperature_kernel`` and ``compute_token_logprobs``
================================  =========================================================================

Each kernel is forward-only: it is wrapped in an autograd function whose backward differentiates a PyTorch
expression of the same math (:class:`_Kernel`), or, for the matmuls and the logprob, an explicit backward.
The forward values, hence the logprobs the loss and ``mismatch_kl`` see, are vLLM's bit for bit; the gradient
is the exact gradient of the reference expression, which differs from the kernels' only by rounding.

The process must call :func:`enable` before CUDA is initialised (vLLM's cuBLAS and NCCL settings are
environment variables read once). vLLM must be importable in the trainer's environment.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "qwen3")  # model_type: the decoder layout this forward reproduces
BLOCK_SIZE = 16  # vLLM's KV-cache block size on CUDA; the paged copy below uses the same
# vLLM pads the vocabulary (embedding and lm_head rows) to a multiple of 64 and hands the sampler the first
# ``vocab`` columns of the padded logits: a view whose row stride is the padded width. Triton specialises a
# kernel on its integer arguments' divisibility by 16, and the logprob kernel's reduction order follows from
# that (measured: with a 103-token vocabulary, 8% of logprobs differed by one ulp until the trainer's logits had
# the same row stride), so the trainer's logits have vLLM's layout too.
VOCAB_PADDING = 64


def padded_vocab(vocab: int) -> int:
    """The row stride of vLLM's logits for a ``vocab``-token model (``vocab_parallel_embedding.pad_vocab_size``)."""
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


def _vllm_layout(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[N, V]`` as vLLM holds them: a view of the first ``V`` columns of ``[N, padded_vocab(V)]``
    (``logits`` itself when it is already laid out so; otherwise a copy)."""
    n, vocab = logits.shape
    if logits.stride() == (padded_vocab(vocab), 1):
        return logits
    buf = logits.new_empty(n, padded_vocab(vocab))
    buf[:, :vocab] = logits
    return buf[:, :vocab]


def enable() -> None:
    """Batch-invariant mode for this process, as vLLM sets it for its own (call before CUDA is initialised)."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

    init_batch_invariance()


@functools.cache
def _vllm() -> types.SimpleNamespace:
    """vLLM's kernels, imported once (after :func:`enable`: some modules read the flag at import)."""
    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        raise RuntimeError("asyncrl.models.bitwise: call enable() first (VLLM_BATCH_INVARIANT=1 before vLLM loads)")
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
    return out + bias if bias is not None else out  # vLLM's linear_batch_invariant adds the bias after the matmul


def rms_reference(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _apply(lambda a, b: _vllm().rms_norm(a, b, eps), lambda a, b: rms_reference(a, b, eps), x, w)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float) -> None:
    """Batch-invariant stand-in for vLLM's ``_custom_ops.fused_add_rms_norm`` (same in-place contract:
    ``residual <- x + residual``, ``x <- RMSNorm(residual)``), installed in vLLM by
    :mod:`asyncrl.inference.vllm_plugin` under ``numerics=bitwise``.

    vLLM 0.26's batch-invariant RMSNorm hands the residual case to that CUDA kernel, which launches 1,024 threads a
    row below 256 tokens and 256 from there on (measured: ``benchmarks/bitwise_probe.py --ops``), so a row's bits
    depended on how many tokens shared its step. An elementwise add and the Triton ``rms_norm_batch_invariant``
    (one program a row) give every row the same bits at any batch size, so vLLM keeps its own step sizes and
    CUDA graphs, and the trainer computes the same."""
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


def rope_reference(positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """NeoX RoPE of ``x`` ``[T, H*D]`` in fp32 from a ``cat(cos, sin)`` cache: the kernel's math, differentiable."""
    cos, sin = cache[positions].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    y = x.float().view(x.shape[0], -1, head_size)
    y1, y2 = y.chunk(2, dim=-1)
    return torch.cat((y1 * cos - y2 * sin, y2 * cos + y1 * sin), dim=-1).flatten(1).to(x.dtype)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor, head_size: int):
    """NeoX-style RoPE of ``q`` ``[T, Hq*D]`` and ``k`` ``[T, Hkv*D]`` with vLLM's kernel and cos/sin cache."""

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

    Built with autocast off whatever the caller's context: under the trainer's bf16 autocast its ``einsum`` ran
    as a bf16 matmul on CUDA, and every logprob moved off vLLM's (measured, H100)."""
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
        self.block_table = (first[:, None] + torch.arange(width, device=lens.device)[None, :]).to(torch.int32)
        self.seq_lens = lens.to(torch.int32)

    def paged(self, x: torch.Tensor) -> torch.Tensor:
        cache = x.new_zeros(self.num_blocks * BLOCK_SIZE, *x.shape[1:])
        cache[self.slots] = x
        return cache.view(self.num_blocks, BLOCK_SIZE, *x.shape[1:])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of ``q`` ``[T, Hq, D]`` over ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq*D]``."""
        from asyncrl.models.attention import packed_attention

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


def _processed(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The sampler's processed logits: divided by the temperature in place, in their own dtype (a no-op at 1)."""
    if bool(((temperatures == 0) | (temperatures == 1)).all()):
        return _vllm_layout(logits)
    logits = _vllm_layout(logits.detach().clone())  # a copy in vLLM's layout (clone alone would pack the rows)
    rows = torch.arange(len(logits), device=logits.device, dtype=torch.int32)
    _vllm().apply_temperature(logits, rows, temperatures.float().contiguous())
    return logits


class _TokenLogprobs(torch.autograd.Function):
    """``log softmax(logits / T)[target]`` per row with the model runner's kernel; the gradient is computed in
    chunks of rows so no fp32 ``[N, V]`` tensor is materialised."""

    @staticmethod
    def forward(ctx, logits, targets, temperatures):
        processed = _processed(logits, temperatures)
        ctx.save_for_backward(processed, targets, temperatures)
        return _vllm().compute_token_logprobs(processed, targets[:, None]).squeeze(1)

    @staticmethod
    def backward(ctx, g):
        processed, targets, temperatures = ctx.saved_tensors
        grad = torch.empty_like(processed)
        chunk = max(1, (1 << 28) // (4 * processed.shape[1]))  # ~256 MiB of fp32 per chunk
        for s in range(0, len(processed), chunk):
            p = torch.softmax(processed[s : s + chunk].float(), dim=-1)
            p.neg_()
            p[torch.arange(len(p), device=p.device), targets[s : s + chunk]] += 1.0
            t = temperatures[s : s + chunk].float()
            t = torch.where(t == 0, torch.ones_like(t), t)  # temperature 0 rows are greedy: no scaling
            grad[s : s + chunk] = (p * (g[s : s + chunk] / t)[:, None]).to(grad.dtype)
        return grad, None, None


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperatures: torch.Tensor, entropy_out: list | None = None
) -> torch.Tensor:
    """Drop-in for :func:`asyncrl.trainer.loss.compute_logprobs` (same shapes and meaning) with the logprobs
    vLLM's sampler returns for ``processed_logprobs``: logits at ``i-1`` score token ``i``."""
    b, length, vocab = logits.shape
    # every position is scored (the last one against a dummy target, then dropped) so the rows stay a view of
    # the forward's padded logits, in vLLM's layout, instead of a packed copy
    targets = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
    temps = torch.cat([temperatures[:, 1:], torch.ones_like(temperatures[:, :1])], dim=1)
    out = _TokenLogprobs.apply(logits.flatten(0, 1), targets.reshape(-1), temps.reshape(-1))
    if entropy_out is not None:
        from asyncrl.trainer.loss import token_entropy

        with torch.no_grad():
            logp = torch.log_softmax(logits[:, :-1].float() / temperatures[:, 1:, None], dim=-1)
            entropy_out.append(token_entropy(logp))
    return out.view(b, length)[:, :-1]


# --- the model ---------------------------------------------------------------------------------------------


def check(config: Any) -> list[str]:
    """Why this forward cannot reproduce vLLM's for ``config`` (an HF model config); empty when it can."""
    errors = []
    if config.model_type not in SUPPORTED:
        errors.append(f"model_type {config.model_type!r} (supported: {', '.join(SUPPORTED)})")
    if getattr(config, "hidden_act", "silu") != "silu":
        errors.append(f"hidden_act {config.hidden_act!r} (supported: 'silu')")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        errors.append(f"rope_type {rope.get('rope_type')!r} (supported: 'default')")
    if getattr(config, "mlp_bias", False):
        errors.append("mlp_bias=True (vLLM's Llama MLP has no bias)")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        errors.append("sliding-window attention")
    return errors


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """A parameter in vLLM's dtype: FSDP2's mixed precision hands bf16 already; fp32 masters are rounded here,
    as the weight export rounds them for vLLM."""
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def _layer_forward(self, hidden, residual, positions, attention, cache, eps):
    """One decoder layer as vLLM's ``LlamaDecoderLayer`` / ``Qwen3DecoderLayer`` runs it."""
    if residual is None:
        residual = hidden
        x = rms_norm(hidden, _bf16(self.input_layernorm.weight), eps)
    else:
        x, residual = add_rms_norm(hidden, residual, _bf16(self.input_layernorm.weight), eps)
    attn = self.self_attn
    d = attn.head_dim
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    w = torch.cat([_bf16(p.weight) for p in projections])  # vLLM's qkv_proj
    bias = torch.cat([_bf16(p.bias) for p in projections]) if attn.q_proj.bias is not None else None
    q_size, kv_size = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    q, k, v = linear(x, w, bias).split([q_size, kv_size, kv_size], dim=-1)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
        q = rms_norm(q.reshape(-1, q_size // d, d), _bf16(attn.q_norm.weight), eps).view(-1, q_size)
        k = rms_norm(k.reshape(-1, kv_size // d, d), _bf16(attn.k_norm.weight), eps).view(-1, kv_size)
    q, k = rotary(positions, q, k, cache, d)
    o = attention(q.view(-1, q_size // d, d), k.view(-1, kv_size // d, d), v.reshape(-1, kv_size // d, d), attn.scaling)
    hidden = linear(o, _bf16(attn.o_proj.weight))
    x, residual = add_rms_norm(hidden, residual, _bf16(self.post_attention_layernorm.weight), eps)
    mlp = self.mlp
    gate_up = linear(x, torch.cat([_bf16(mlp.gate_proj.weight), _bf16(mlp.up_proj.weight)]))  # gate_up_proj
    return linear(silu_and_mul(gate_up), _bf16(mlp.down_proj.weight)), residual


def _causal_lm_forward(self, input_ids, position_ids, **_ignored):
    """The patched ``forward`` of the causal LM: logits ``[B, L, V]`` (bf16) of packed rows."""
    from asyncrl.models.attention import cu_seqlens_from_positions

    cfg = self.config
    b, length = input_ids.shape
    # Under FSDP2's mixed precision the parameters arrive in bf16 already; otherwise they are cast here. Nothing
    # below may run under the caller's autocast (Fabric's bf16-mixed): vLLM computes without one.
    with torch.autocast(input_ids.device.type, enabled=False):
        positions = position_ids.expand(b, -1).reshape(-1)
        cu, max_len = cu_seqlens_from_positions(positions.view(b, length))
        attention = PackedAttention(cu, max_len)
        rope = cfg.rope_parameters or {}
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cache = rope_cache(
            head_dim, float(rope.get("rope_theta", 10000.0)), cfg.max_position_embeddings, str(input_ids.device)
        )
        base = self.model
        # padding_idx: no gradient into the pad token's row, as nn.Embedding does (the forward is a plain gather)
        embed = base.embed_tokens
        hidden = F.embedding(input_ids.reshape(-1), _bf16(embed.weight), padding_idx=embed.padding_idx)
        residual: Any = None
        for layer in base.layers:
            hidden, residual = layer(hidden, residual, positions, attention, cache, cfg.rms_norm_eps)
        hidden, _ = add_rms_norm(hidden, residual, _bf16(base.norm.weight), cfg.rms_norm_eps)
        head = _bf16(self.lm_head.weight)
        vocab = head.shape[0]
        if padded_vocab(vocab) != vocab:  # vLLM's padded lm_head: zero rows, sliced off its logits (see above)
            head = torch.cat([head, head.new_zeros(padded_vocab(vocab) - vocab, head.shape[1])])
        logits = linear(hidden, head)[:, :vocab]
    return types.SimpleNamespace(logits=logits.view(b, length, vocab))


def install(model: Any) -> Any:
    """Give ``model`` (an HF Llama/Qwen2/Qwen3 causal LM, before FSDP2 or activation checkpointing wraps it) the
    vLLM-kernel forward; sets ``model.asyncrl_token_logprobs`` for the trainer. Returns ``model``."""
    errors = check(model.config)
    if errors:
        raise ValueError("numerics=bitwise cannot reproduce vLLM's forward for this model: " + "; ".join(errors))
    _vllm()
    for layer in model.model.layers:
        layer.forward = types.MethodType(_layer_forward, layer)
    model.forward = types.MethodType(_causal_lm_forward, model)
    model.asyncrl_token_logprobs = token_logprobs
    return model
