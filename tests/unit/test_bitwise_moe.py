"""numerics=bitwise for a mixture of experts (asyncrl.models.vllm_moe): vLLM's router and fused-experts
kernels, differentiated through PyTorch expressions of the same math. vLLM's kernels are GPU-only; here
PyTorch stands in for them (the same values a GPU kernel would give up to rounding), so what is checked is
the plumbing: the forward is the kernels', the gradient is transformers' own, and router replay keeps the
kernel's weights where the replayed experts are its own (tests/gpu/test_moe_vllm.py runs the kernels against
vLLM)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.models import vllm_moe
from asyncrl.models.moe import Routing
from helpers import moe_fakes


@pytest.fixture
def block(micro_moe, monkeypatch):
    """The first MoE block of the micro Qwen3-MoE in fp32, with PyTorch standing in for vLLM's two
    kernels."""
    calls = {"experts": 0}

    def fused_experts(*args):
        calls["experts"] += 1
        return moe_fakes.fused_experts(*args)

    monkeypatch.setattr(vllm_moe, "_moe", lambda: (moe_fakes.topk_softmax, fused_experts))
    model = AutoModelForCausalLM.from_pretrained(micro_moe, dtype=torch.float32)
    mlp = model.model.layers[0].mlp
    return mlp, calls


def test_router_and_experts_give_transformers_values_and_gradients(block):
    mlp, calls = block
    x = torch.randn(12, mlp.gate.hidden_dim, requires_grad=True)
    logits, ref_weights, ref_ids = mlp.gate(x)
    ref = mlp.experts(x, ref_ids, ref_weights)
    (ref * torch.linspace(-1, 1, ref.shape[-1])).sum().backward()
    ref_grads = [
        t.grad.clone() for t in (x, mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj)
    ]
    for t in (x, mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj):
        t.grad = None

    weights, ids = vllm_moe.route(torch.nn.functional.linear(x, mlp.gate.weight), mlp.gate.top_k, True)
    assert torch.equal(ids.long(), ref_ids) and torch.allclose(weights, ref_weights, atol=1e-6)
    out = vllm_moe.experts(x, mlp.experts.gate_up_proj, mlp.experts.down_proj, weights, ids)
    assert calls["experts"] == 1 and torch.allclose(out, ref, atol=1e-5)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = [t.grad for t in (x, mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj)]
    for got, want in zip(grads, ref_grads, strict=True):
        assert got is not None and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_routing_weights_are_the_softmax_of_the_picked_experts():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    ids = torch.tensor([[0, 2]])
    p = torch.softmax(logits, -1)
    assert torch.allclose(vllm_moe.routing_weights(logits, ids, False), p[:, [0, 2]])
    assert torch.allclose(vllm_moe.routing_weights(logits, ids, True), p[:, [0, 2]] / p[:, [0, 2]].sum())


def test_replay_keeps_the_routers_own_weights_where_it_picked_the_same_experts(micro_moe):
    """A kernel's weights (here off by a known amount, as a kernel's softmax may be in its last bit) stay
    where the replayed experts are the router's own picks in its order; other tokens get the softmax of the
    given ones."""
    model = AutoModelForCausalLM.from_pretrained(micro_moe, dtype=torch.float32)
    router = model.model.layers[0].mlp.gate
    own = router.forward

    def kernel_like(x):
        logits, weights, ids = own(x)
        return logits, weights + 1e-3, ids  # a mark the replay must keep on the tokens it does not change

    router.forward = kernel_like
    routing = Routing(model, replay=True)
    x = torch.randn(4, router.hidden_dim)
    _, weights, picks = kernel_like(x)
    layers = len(routing.routers)
    given = picks[:, None, :].expand(4, layers, -1).clone()
    given[1, 0] = given[1, 0].flip(-1)  # token 1: the same experts in another order
    # token 2: another expert
    given[2, 0, 0] = (set(range(router.num_experts)) - set(picks[2].tolist())).pop()
    with routing.given(given):
        _, replayed, used = router(x)
    assert torch.equal(used, given[:, 0]) and torch.equal(replayed[[0, 3]], weights[[0, 3]])
    probs = torch.softmax(torch.nn.functional.linear(x, router.weight), -1)
    for t in (1, 2):
        expected = probs[t, given[t, 0]] / probs[t, given[t, 0]].sum()
        assert torch.allclose(replayed[t], expected)
