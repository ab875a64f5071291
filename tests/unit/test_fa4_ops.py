"""flash-attn-4 as torch custom ops (models/fa4.py), on CPU: exact reference kernels with flash-attn-4's
calling convention stand in for its CUDA kernels, so what is checked is the glue: shapes, gradients,
grouped-query heads, the ops' registration (opcheck) and that a compiled function keeps them in one graph
(fullgraph)."""

import pytest
import torch

from asyncrl.models import attention, fa4


def _scores(q, k, cu, scale):
    """Per sample: (start, end, causal scores [H, n, n]) with key/value heads repeated for their query
    heads."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
        yield a, b, s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))


def ref_fwd(q, k, v, *, cu_seqlens_q, softmax_scale, causal, return_lse, **_):
    assert causal and return_lse and softmax_scale is not None
    rep = q.shape[1] // k.shape[1]
    out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for a, b, s in _scores(q, k, cu_seqlens_q, softmax_scale):
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:b].repeat_interleave(rep, dim=1))
        lse[:, a:b] = s.logsumexp(-1)
    return out, lse, None, None, None


def ref_bwd(q, k, v, out, dout, lse, softmax_scale, causal, *, cu_seqlens_q, **_):
    """FlashAttention's backward, written out: dS = P * (dP - rowsum(dO * O))."""
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b, s in _scores(q, k, cu_seqlens_q, softmax_scale):
        p = (s - lse[:, a:b, None]).exp()
        vv = v[a:b].repeat_interleave(rep, dim=1)
        dp = torch.einsum("qhd,khd->hqk", dout[a:b], vv)
        ds = p * (dp - (dout[a:b] * out[a:b]).sum(-1).T[:, :, None])
        kk = k[a:b].repeat_interleave(rep, dim=1)
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kk) * softmax_scale
        dk[a:b] = (torch.einsum("hqk,qhd->khd", ds, q[a:b]) * softmax_scale).unflatten(1, (-1, rep)).sum(2)
        dv[a:b] = torch.einsum("hqk,qhd->khd", p, dout[a:b]).unflatten(1, (-1, rep)).sum(2)
    return dq, dk, dv


@pytest.fixture
def ref_kernels(monkeypatch):
    """The reference kernels in flash-attn-4's place; yields the number of forward calls made so far."""
    calls = []

    def counted_fwd(*args, **kwargs):
        calls.append(1)
        return ref_fwd(*args, **kwargs)

    monkeypatch.setattr(fa4, "kernels", lambda: (counted_fwd, ref_bwd))
    yield calls


def _inputs(kv_heads, lens=(3, 7, 1, 5), heads=4, dim=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, max(lens)


@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: grouped-query attention
def test_forward_and_gradients_match_exact_attention(ref_kernels, kv_heads):
    q, k, v, cu, m = _inputs(kv_heads)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fa4.packed_attention_fa4(*leaves, cu, m)
    grad = torch.randn_like(out)
    out.backward(grad)
    exact = [x.clone().requires_grad_(True) for x in (q, k, v)]
    truth = attention.per_sample_attention(*exact, cu)
    truth.backward(grad)
    torch.testing.assert_close(out, truth)
    for a, b in zip(leaves, exact, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_ops_pass_torch_library_opcheck(ref_kernels):
    """Schema, fake (shape-only) implementations against the real outputs, and the registered backward."""
    q, k, v, cu, m = _inputs(2)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    torch.library.opcheck(fa4.varlen_fwd, (q, k, v, cu, m, 0.3))
    q, k, v = (x.detach() for x in (q, k, v))  # the backward op has no backward of its own
    out, lse = fa4.varlen_fwd(q, k, v, cu, m, 0.3)
    torch.library.opcheck(fa4.varlen_bwd, (torch.randn_like(out), q, k, v, out, lse, cu, m, 0.3))


def test_a_compiled_layer_keeps_the_kernel_in_one_graph(ref_kernels):
    """fullgraph=True fails on any graph break: what transformers' flash_attention_4 path (an
    autograd.Function dynamo cannot trace) would cause in each compiled decoder layer."""
    q, k, v, cu, m = _inputs(2)

    def layer(q, k, v):
        return fa4.packed_attention_fa4(q * 2, k, v.sin(), cu, m).square().sum()

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(*leaves)
    compiled.backward()
    eager = [x.clone().requires_grad_(True) for x in (q, k, v)]
    layer(*eager).backward()
    torch.testing.assert_close(compiled, layer(q, k, v))
    for a, b in zip(leaves, eager, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_packed_rows_of_a_model_match_sdpa(ref_kernels, tmp_path):
    """attn_implementation=varlen_fa4 on a micro model: packed rows give each sample's sdpa logits."""
    from transformers import AutoModelForCausalLM

    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from asyncrl.trainer.forward import packed_logprobs
    from helpers.inputs import two_packed_rows
    from helpers.launch import MICRO_MODEL

    init = compose_config([*MICRO_MODEL, "model.init.num_key_value_heads=2"]).model.init
    path = build_tiny_model(init, tmp_path, seed=0)
    attention.register()
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="varlen_fa4").eval()
    mb = two_packed_rows()
    with torch.no_grad():
        got = packed_logprobs(model, mb)
        want = packed_logprobs(ref, mb)  # sdpa: the block-diagonal mask from position_ids
    assert len(ref_kernels) == model.config.num_hidden_layers  # one kernel call per layer, none for sdpa
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_missing_flash_attn_4_names_the_key(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match="model.attn_implementation=varlen_fa4 needs flash-attn-4"):
        fa4.check_installed()
