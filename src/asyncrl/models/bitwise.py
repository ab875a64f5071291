"""``numerics=bitwise`` on GPU: the trainer's forward built from the kernels vLLM runs in batch-invariant
mode.

vLLM with ``VLLM_BATCH_INVARIANT=1``, its eager ops (CUDA graphs replay them; Inductor would fuse them
differently), the Triton attention backend and asyncrl's vLLM plugin (:func:`fused_add_rms_norm` in place of
vLLM's CUDA kernel, see below) computes every row of a batch the same whatever else is in the batch, and a
decode step computes a token's row as a prefill would (measured on an H100: ``benchmarks/bitwise_probe.py``).
This module makes the trainer compute that same row: a Llama/Qwen2/Qwen3/Qwen3-MoE forward pass (the HF
model's own parameters, laid out as vLLM lays them: q/k/v and gate/up projections concatenated) that calls,
op for op and in vLLM's order, the functions vLLM's layers call:

================================  =========================================================================
vLLM layer (batch-invariant)       kernel, called here too ================================
========================================================================= linear layers, ``lm_head``
``batch_invariant.matmul_persistent`` (Triton, fixed tiles, no split-K) first ``input_layernorm``,
``batch_invariant.rms_norm_batch_invariant`` (Triton, one program a row) q/k norms (Qwen3) residual add +
RMSNorm             :func:`fused_add_rms_norm`: an add, then the Triton RMSNorm (asyncrl's plugin
                                   puts it in vLLM, whose CUDA kernel is not batch-invariant)
RoPE                               ``_C.rotary_embedding`` on vLLM's own cos/sin cache
attention                          ``triton_unified_attention.unified_attention`` (2-D kernel), on a paged
                                   copy of the packed rows' keys and values
SiLU * up                          ``_C.silu_and_mul`` MoE router (Qwen3-MoE)             the gate's linear,
then ``_moe_C.topk_softmax`` (:mod:`asyncrl.models.vllm_moe`) MoE experts
``fused_moe.fused_experts`` (Triton, one fixed tile configuration) sampled token's logprob            V2
model runner: its ``_temperature_kernel`` and ``compute_token_logprobs``;
                                   V1 (a mixture of experts): fp32 division, ``batch_invariant.log_softmax``
================================  =========================================================================

vLLM 0.26 serves a mixture of experts with its V1 model runner and other models with V2
(``vllm/config/vllm.py``, ``use_v2_model_runner``; V2 does not return routed experts), and their samplers
round differently: V1 divides the logits by the temperature after upcasting them to fp32, V2 in the model's
bf16. :func:`sampler_runner` names the runner for a model, the trainer computes that runner's logprobs, and
the sidecar is pinned to it (:func:`runner_env`), so a vLLM that chose otherwise cannot silently break the
match.

The kernels, each made differentiable, are in :mod:`asyncrl.models.vllm_kernels` (the sampler's logprobs
in :mod:`asyncrl.models.vllm_logprobs`): the forward values, hence the logprobs the loss and ``mismatch_kl``
see, are vLLM's bit for bit.

The process must call :func:`enable` before CUDA is initialised (vLLM's cuBLAS and NCCL settings are
environment variables read once). vLLM must be importable in the trainer's environment.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.models import vllm_kernels, vllm_moe
from asyncrl.models.attention import cu_seqlens_from_positions
from asyncrl.models.vllm_kernels import (
    PackedAttention,
    add_rms_norm,
    enable,
    fused_add_rms_norm,
    linear,
    padded_vocab,
    rms_norm,
    rope_cache,
    rotary,
    silu_and_mul,
)
from asyncrl.models.vllm_logprobs import token_logprobs

# what a process that runs numerics=bitwise calls here: enable() first, install() on the model; vLLM's plugin
# (asyncrl.inference.vllm.plugin) puts fused_add_rms_norm in place of vLLM's own
__all__ = [
    "check",
    "enable",
    "fused_add_rms_norm",
    "install",
    "runner_env",
    "sampler_runner",
    "token_logprobs",
]

SUPPORTED = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
)  # model_type: the decoder layout this forward reproduces
MIXTURES = ("qwen3_moe",)  # of SUPPORTED, the mixtures of experts
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM 0.26's switch between its model runners


def sampler_runner(config: Any) -> str:
    """The vLLM model runner whose sampler the trainer mirrors for ``config`` (an HF model config): ``"v1"``
    for a mixture of experts, ``"v2"`` otherwise (:data:`asyncrl.models.vllm_logprobs.SAMPLERS`)."""
    return "v1" if config.model_type in MIXTURES else "v2"


def runner_env(config: Any) -> dict[str, str]:
    """The environment that pins the sidecar's vLLM to :func:`sampler_runner`'s runner for ``config``."""
    return {RUNNER_ENV: "0" if sampler_runner(config) == "v1" else "1"}


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
    if getattr(config, "shared_expert_intermediate_size", 0):
        errors.append("shared experts (vLLM adds them beside the routed ones)")
    return errors


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """A parameter in vLLM's dtype: FSDP2's mixed precision hands bf16 already; fp32 masters are rounded
    here, as the weight export rounds them for vLLM."""
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
    o = attention(
        q.view(-1, q_size // d, d), k.view(-1, kv_size // d, d), v.reshape(-1, kv_size // d, d), attn.scaling
    )
    hidden = linear(o, _bf16(attn.o_proj.weight))
    x, residual = add_rms_norm(hidden, residual, _bf16(self.post_attention_layernorm.weight), eps)
    return self.mlp(x), residual


def _mlp_forward(self, x):
    """A dense MLP as vLLM's ``LlamaMLP`` runs it: one gate/up projection, SiLU * up, the down projection."""
    # gate_up_proj
    gate_up = linear(x, torch.cat([_bf16(self.gate_proj.weight), _bf16(self.up_proj.weight)]))
    return linear(silu_and_mul(gate_up), _bf16(self.down_proj.weight))


def _router_forward(self, x):
    """A MoE router as vLLM's runs it: ``(logits, weights, ids)``, the output transformers' router answers,
    so the hooks of :class:`asyncrl.models.moe.Routing` record and replay it as they do the model's own."""
    logits = linear(x, _bf16(self.weight))
    weights, ids = vllm_moe.route(logits, self.top_k, self.norm_topk_prob)
    return logits, weights, ids


def _moe_forward(self, x):
    """A sparse MoE block as vLLM's ``FusedMoE`` runs it: the router, then the fused experts with its
    weights."""
    _, weights, ids = self.gate(x)
    return vllm_moe.experts(x, _bf16(self.experts.gate_up_proj), _bf16(self.experts.down_proj), weights, ids)


def _causal_lm_forward(self, input_ids, position_ids, **_ignored):
    """The patched ``forward`` of the causal LM: logits ``[B, L, V]`` (bf16) of packed rows."""
    cfg = self.config
    b, length = input_ids.shape
    # Under FSDP2's mixed precision the parameters arrive in bf16 already; otherwise they are cast here.
    # Nothing below may run under the caller's autocast (Fabric's bf16-mixed): vLLM computes without one.
    with torch.autocast(input_ids.device.type, enabled=False):
        positions = position_ids.expand(b, -1).reshape(-1)
        cu, max_len = cu_seqlens_from_positions(positions.view(b, length))
        attention = PackedAttention(cu, max_len)
        rope = cfg.rope_parameters or {}
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cache = rope_cache(
            head_dim,
            float(rope.get("rope_theta", 10000.0)),
            cfg.max_position_embeddings,
            str(input_ids.device),
        )
        base = self.model
        # padding_idx: no gradient into the pad token's row, as nn.Embedding does (the forward is a plain
        # gather)
        embed = base.embed_tokens
        hidden = F.embedding(input_ids.reshape(-1), _bf16(embed.weight), padding_idx=embed.padding_idx)
        residual: Any = None
        for layer in base.layers:
            hidden, residual = layer(hidden, residual, positions, attention, cache, cfg.rms_norm_eps)
        hidden, _ = add_rms_norm(hidden, residual, _bf16(base.norm.weight), cfg.rms_norm_eps)
        head = _bf16(self.lm_head.weight)
        vocab = head.shape[0]
        # vLLM's padded lm_head: zero rows, sliced off its logits (see above)
        if padded_vocab(vocab) != vocab:
            head = torch.cat([head, head.new_zeros(padded_vocab(vocab) - vocab, head.shape[1])])
        logits = linear(hidden, head)[:, :vocab]
    return types.SimpleNamespace(logits=logits.view(b, length, vocab))


def install(model: Any) -> Any:
    """Give ``model`` (an HF Llama/Qwen2/Qwen3/Qwen3-MoE causal LM, before FSDP2 or activation checkpointing
    wraps it) the vLLM-kernel forward; sets ``model.asyncrl_token_logprobs`` for the trainer. Returns
    ``model``."""
    errors = check(model.config)
    if errors:
        raise ValueError(
            "numerics=bitwise cannot reproduce vLLM's forward for this model: " + "; ".join(errors)
        )
    vllm_kernels._vllm()  # imports vLLM's kernels now, failing here if enable() was not called
    for layer in model.model.layers:
        layer.forward = types.MethodType(_layer_forward, layer)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):  # one interface: a layer calls its mlp, dense or mixture of experts
            mlp.gate.forward = types.MethodType(_router_forward, mlp.gate)
            mlp.forward = types.MethodType(_moe_forward, mlp)
        else:
            mlp.forward = types.MethodType(_mlp_forward, mlp)
    model.forward = types.MethodType(_causal_lm_forward, model)
    model.asyncrl_token_logprobs = functools.partial(token_logprobs, runner=sampler_runner(model.config))
    return model
