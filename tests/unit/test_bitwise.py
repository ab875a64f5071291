"""``asyncrl.models.bitwise`` without a GPU: vLLM's kernels replaced by CPU stand-ins that compute the same
math (the paged attention one reads keys through the block table, as vLLM's kernel does), so the forward's
structure (vLLM's op order, fused q/k/v and gate/up weights, residual threading, RoPE, paging of packed rows)
and every backward are checked against the HF model's own forward and gradient. Whether the real kernels give
vLLM's bits is the GPU test's job (tests/gpu/test_gpu.py)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from asyncrl.models import bitwise, vllm_kernels, vllm_logprobs, vllm_moe
from helpers import moe_fakes


class _Rope:  # vLLM's RotaryEmbedding cache code, as the real one runs it
    def _compute_inv_freq(self, base):
        return 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    def _compute_cos_sin_cache(self):
        freqs = torch.einsum(
            "i,j -> ij",
            torch.arange(self.max_position_embeddings, dtype=torch.float),
            self._compute_inv_freq(self.base),
        )
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _paged_attention(
    q,
    k,
    v,
    out,
    cu_seqlens_q,
    max_seqlen_q,
    seqused_k,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_size,
    block_table,
    softcap,
    q_descale,
    k_descale,
    v_descale,
):
    bs = k.shape[1]
    for i in range(len(seqused_k)):
        a, b, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
        j = torch.arange(n)
        keys = k[block_table[i, j // bs].long(), j % bs]  # [n, Hkv, D], read through the block table
        vals = v[block_table[i, j // bs].long(), j % bs]
        rep = q.shape[1] // k.shape[2]
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).float(),
            keys.repeat_interleave(rep, 1).transpose(0, 1).float(),
            vals.repeat_interleave(rep, 1).transpose(0, 1).float(),
            is_causal=True,
            scale=softmax_scale,
        )
        out[a:b] = o.transpose(0, 1).to(out.dtype)


def _temperature(logits, rows, temps):
    t = temps[rows.long()]
    scale = (t != 0) & (t != 1)
    logits[scale] = (logits[scale].float() / t[scale, None]).to(logits.dtype)


def _fused_add(a, r, w, eps):
    z = (a.float() + r.float()).to(a.dtype)
    r.copy_(z)
    a.copy_(vllm_kernels.rms_reference(z, w, eps))


def _rotary_inplace(pos, q, k, head, cache, neox):
    q.copy_(vllm_kernels.rope_reference(pos, q, cache, head))
    k.copy_(vllm_kernels.rope_reference(pos, k, cache, head))


FAKES = types.SimpleNamespace(
    fused_add_rms_norm=_fused_add,
    rotary_embedding=_rotary_inplace,
    silu_and_mul=lambda out, x: out.copy_(
        (F.silu(x[..., : out.shape[-1]].float()) * x[..., out.shape[-1] :]).to(x.dtype)
    ),
    matmul=lambda a, b: a @ b,
    rms_norm=lambda x, w, eps: vllm_kernels.rms_reference(x.reshape(-1, x.shape[-1]), w, eps).view(x.shape),
    RotaryEmbedding=_Rope,
    unified_attention=_paged_attention,
    apply_temperature=_temperature,
    compute_token_logprobs=lambda logits, ids: torch.log_softmax(logits.float(), -1).gather(-1, ids),
    log_softmax=lambda x, dim=-1: torch.log_softmax(x, dim),
)


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setattr(vllm_kernels, "_vllm", lambda: FAKES)
    monkeypatch.setattr(vllm_moe, "_moe", lambda: (moe_fakes.topk_softmax, moe_fakes.fused_experts))
    vllm_kernels.rope_cache.cache_clear()
    yield
    vllm_kernels.rope_cache.cache_clear()


def _model(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {
        "qwen2": {"use_sliding_window": False},
        "qwen3": {"head_dim": 16},
        # every layer a MoE layer, as vLLM's routes need; experts narrower than the dense MLP, as in
        # Qwen3-MoE
        "qwen3_moe": {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    }.get(kind, {})
    cfg = AutoConfig.for_model(
        kind,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=True,
        pad_token_id=3,  # occurs in the inputs: nn.Embedding gives its row no gradient
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.bfloat16)
    if kind == "qwen2":  # biased q/k/v
        for layer in model.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(p.bias, std=0.3)
    return model


def _packed(lengths_per_row: list[list[int]]):
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randint(0, 97, (sum(r),), generator=g) for r in lengths_per_row])
    ids[:, ::4] = 3  # the pad token, as chat templates repeat their special tokens
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in lengths_per_row])
    return ids, pos


ROWS = [[5, 21, 16], [40, 2]]  # sequences not a multiple of the block size, and several per row


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_forward_and_gradient_match_the_hf_model(fakes, kind):
    ids, pos = _packed(ROWS)
    ref = _model(kind)
    ours = bitwise.install(_model(kind))
    exact = _model(kind).float()(input_ids=ids, position_ids=pos, use_cache=False).logits.detach()
    hf = ref(input_ids=ids, position_ids=pos, use_cache=False).logits.detach().float()
    got = ours(input_ids=ids, position_ids=pos, use_cache=False).logits.detach().float()
    assert got.shape == exact.shape
    # as close to the fp32 forward as HF's own bf16 forward is (they round in different places); a wrong op
    # (order, weight, rotation, paging) is off by O(1)
    err = float((got - exact).norm() / exact.norm())
    assert err < 1.5 * float((hf - exact).norm() / exact.norm()) + 1e-3 and err < 0.1
    # the gradient of a loss through every custom backward, against autograd through the HF model
    temps = torch.full(ids.shape, 0.7)
    for model, fn in ((ref, None), (ours, ours.asyncrl_token_logprobs)):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        if fn is None:
            from asyncrl.models.logprobs import compute_logprobs

            lp = compute_logprobs(logits, ids, temps)
        else:
            lp = fn(logits, ids, temps)
        (lp * torch.linspace(-1, 1, lp.numel()).view(lp.shape)).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=False):
        cos = F.cosine_similarity(a.grad.float().flatten(), b.grad.float().flatten(), dim=0)
        assert cos > 0.97, (name, float(cos))


def test_token_logprobs_match_compute_logprobs_and_their_gradient(fakes):
    from asyncrl.models.logprobs import compute_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 9, 31, dtype=torch.bfloat16) * 3
    ids = torch.randint(0, 31, (2, 9))
    temps = torch.tensor([[1.0] * 9, [0.7] * 4 + [0.0] * 5])
    grads = []
    for fn in (compute_logprobs, vllm_logprobs.token_logprobs):
        x = logits.clone().requires_grad_(True)
        lp = fn(
            x,
            ids,
            torch.where(temps == 0, torch.ones_like(temps), temps) if fn is compute_logprobs else temps,
        )
        lp.sum().backward()
        grads.append((lp.detach(), x.grad.float()))
    (a, ga), (b, gb) = grads
    assert torch.allclose(a, b, atol=0.05)  # the processed logits are rounded to bf16, as vLLM's are
    assert F.cosine_similarity(ga.flatten(), gb.flatten(), dim=0) > 0.99


def test_a_mixture_of_experts_gets_the_v1_runners_logprobs(fakes):
    # vLLM 0.26 serves a mixture of experts with its V1 model runner, whose sampler upcasts the logits to
    # fp32 before dividing by the temperature (vllm/v1/sample/sampler.py); V2 divides the bf16 logits. Each
    # model's logprob function is its runner's, and the two differ at a temperature other than 1.
    assert [bitwise.sampler_runner(_model(k).config) for k in ("qwen3", "qwen3_moe")] == ["v2", "v1"]
    assert bitwise.runner_env(_model("qwen3_moe").config) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert bitwise.install(_model("qwen3_moe")).asyncrl_token_logprobs.keywords == {"runner": "v1"}
    assert bitwise.install(_model("qwen3")).asyncrl_token_logprobs.keywords == {"runner": "v2"}
    torch.manual_seed(0)
    logits = torch.randn(2, 9, 97, dtype=torch.bfloat16) * 3
    ids = torch.randint(0, 97, (2, 9))
    temps = torch.tensor([[0.7] * 9, [1.0] * 4 + [0.0] * 5])
    x = logits.clone().requires_grad_(True)
    v1 = vllm_logprobs.token_logprobs(x, ids, temps, runner="v1")
    v1.sum().backward()
    # vLLM's V1 sampler, written out: fp32 logits, greedy rows undivided, log_softmax, the sampled token's
    # value
    ref_x = logits.clone().float().requires_grad_(True)
    t = torch.where(temps < 1e-5, torch.ones_like(temps), temps)
    ref = torch.log_softmax(ref_x / t[..., None], -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref.sum().backward()
    assert torch.equal(v1.detach(), ref.detach())
    assert torch.allclose(x.grad.float(), ref_x.grad, atol=1e-2)  # the bf16 logits' gradient, rounded
    v2 = vllm_logprobs.token_logprobs(logits, ids, temps)
    assert torch.equal(v2[1, :3], v1[1, :3].detach())  # temperature 1: both see the same fp32 values
    assert not torch.equal(v2[0], v1[0].detach())  # 0.7: V2's processed logits are rounded to bf16


def test_v1_refuses_min_p_it_does_not_reproduce(fakes):
    from asyncrl.models.truncation import Truncation

    ids, logits = torch.zeros(1, 4, dtype=torch.long), torch.randn(1, 4, 97, dtype=torch.bfloat16)
    cut = Truncation(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), 0.9), torch.full((1, 4), 0.05))
    with pytest.raises(ValueError, match="min_p on a model vLLM serves with its V1 runner"):
        vllm_logprobs.token_logprobs(logits, ids, torch.ones(1, 4), truncation=cut, runner="v1")
    vllm_logprobs.token_logprobs(logits, ids, torch.ones(1, 4), truncation=cut)  # V2's min_p is mirrored
    top_p = Truncation(cut.top_k, cut.top_p, torch.zeros(1, 4))
    vllm_logprobs.token_logprobs(logits, ids, torch.ones(1, 4), truncation=top_p, runner="v1")
    assert top_p.outside is not None


def test_the_residual_norm_keeps_vllms_in_place_contract(fakes):
    # vLLM's RMSNorm calls it as its CUDA op: residual <- x + residual, x <- RMSNorm(residual), nothing
    # returned
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(7, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    w = torch.rand(32, generator=g).to(torch.bfloat16) + 0.5
    x2, r2 = x.clone(), r.clone()
    assert vllm_kernels.fused_add_rms_norm(x2, r2, w, 1e-6) is None
    assert torch.equal(r2, x + r) and torch.equal(x2, vllm_kernels.rms_reference(x + r, w, 1e-6))
    # a row's bits do not depend on the other rows (the fake norm is per row too; the GPU probe checks the
    # real)
    x3, r3 = x[:3].clone(), r[:3].clone()
    vllm_kernels.fused_add_rms_norm(x3, r3, w, 1e-6)
    assert torch.equal(x3, x2[:3])


def test_paging_gives_every_sample_its_own_blocks():
    cu = torch.tensor([0, 5, 26, 42], dtype=torch.int32)
    att = vllm_kernels.PackedAttention(cu, 21)
    assert att.num_blocks == 1 + 2 + 1
    # entries past a sample's length are never read
    assert att.block_table.tolist() == [[0, 1], [1, 2], [3, 4]]
    assert att.slots.tolist() == list(range(5)) + list(range(16, 37)) + list(range(48, 64))
    x = torch.arange(42.0)[:, None, None]
    cache = att.paged(x)
    assert cache.shape == (4, 16, 1, 1)
    assert cache[2, 4, 0, 0] == 25 and cache[3, 15, 0, 0] == 41 and cache[0, 5, 0, 0] == 0


def test_unsupported_models_are_refused_with_the_reason():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gpt2")
    assert "model_type 'gpt2'" in bitwise.check(cfg)[0]
    llama = AutoConfig.for_model(
        "llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    )
    assert any("rope_type 'linear'" in e for e in bitwise.check(llama))
    with pytest.raises(ValueError, match="numerics=bitwise cannot reproduce"):
        bitwise.install(types.SimpleNamespace(config=cfg))


def test_kernels_need_the_batch_invariant_flag(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    vllm_kernels._vllm.cache_clear()
    with pytest.raises(RuntimeError, match="enable"):
        vllm_kernels._vllm()


def test_logits_reach_the_logprob_kernel_in_vllms_padded_layout(fakes, monkeypatch):
    # vLLM pads the vocabulary to a multiple of 64 and its sampler reads a view of the padded logits; the
    # Triton kernel's reduction order depends on that row stride, so ours must be the same (97 tokens ->
    # stride 128)
    seen = []

    def spy(logits, ids):
        seen.append(logits.stride())
        return FAKES.compute_token_logprobs(logits, ids)

    spying = types.SimpleNamespace(**{**vars(FAKES), "compute_token_logprobs": spy})
    monkeypatch.setattr(vllm_kernels, "_vllm", lambda: spying)
    ids, pos = _packed(ROWS)
    model = bitwise.install(_model("qwen3"))
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert logits.shape[-1] == 97 and logits.stride()[-2:] == (128, 1)
    # as is, and after the temperature copy
    for temps in (torch.ones(ids.shape), torch.full(ids.shape, 0.7)):
        lp = vllm_logprobs.token_logprobs(logits, ids, temps)
        assert lp.shape == (2, ids.shape[1] - 1)
    flat = torch.randn(3, 5, 97, dtype=torch.bfloat16)  # a plain contiguous tensor is copied into the layout
    vllm_logprobs.token_logprobs(flat, torch.zeros(3, 5, dtype=torch.long), torch.ones(3, 5))
    assert seen == [(128, 1)] * 3
    assert vllm_kernels.padded_vocab(151936) == 151936 and vllm_kernels.padded_vocab(49152) == 49152


def test_the_forward_ignores_the_callers_autocast(fakes, monkeypatch):
    # the trainer runs its forward under Fabric's bf16 autocast: nothing of ours may be recast by it. The
    # RoPE cache, built on first use, once was: on CUDA its einsum became a bf16 matmul and every logprob
    # moved off vLLM's (H100). CPU autocast leaves that einsum alone, so the check is on the context the
    # cache is built in.
    contexts = []

    class Rope(_Rope):
        def _compute_cos_sin_cache(self):
            contexts.append(torch.is_autocast_enabled("cpu"))
            return _Rope._compute_cos_sin_cache(self)

    monkeypatch.setattr(FAKES, "RotaryEmbedding", Rope)
    ids, pos = _packed(ROWS)
    model = bitwise.install(_model("qwen3"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = model(input_ids=ids, position_ids=pos).logits
    vllm_kernels.rope_cache.cache_clear()
    plain = model(input_ids=ids, position_ids=pos).logits
    assert contexts == [False, False]
    assert torch.equal(under, plain)
