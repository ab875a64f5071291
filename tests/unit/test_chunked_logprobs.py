"""The trainer's chunked logprob head (models/logprobs.py: chunked_logprobs), what it uses on GPUs: the same
logprobs, entropies and gradients as the eager formula (compute_logprobs) across chunk boundaries, without
keeping a [T, vocab] fp32 tensor for the backward."""

from __future__ import annotations

import pytest
import torch

from asyncrl.models import logprobs as lp


def inputs(dtype: torch.dtype, b: int = 2, t: int = 11, v: int = 50):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(b, t, v, generator=g) * 3).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (b, t), generator=g)
    temps = torch.rand(b, t, generator=g) + 0.5
    return logits, ids, temps


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_chunked_head_equals_the_eager_formula(monkeypatch, dtype, tol):
    monkeypatch.setattr(lp, "CHUNK", 4)  # 10 positions: chunks of 4, 4 and 2
    logits, ids, temps = inputs(dtype)
    ent_ref: list = []
    ref = lp.compute_logprobs(logits, ids, temps, ent_ref)
    (grad_ref,) = torch.autograd.grad((ref * torch.linspace(-1, 1, ref.numel()).view_as(ref)).sum(), logits)
    ent: list = []
    got = lp.chunked_logprobs(logits, ids, temps, ent)
    (grad,) = torch.autograd.grad((got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum(), logits)
    assert got.dtype == torch.float32 and got.shape == ref.shape == (2, 10)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[0], ent_ref[0], rtol=1e-5, atol=1e-5)
    assert grad.dtype == dtype and not grad[:, -1].any()  # the last position predicts nothing
    torch.testing.assert_close(grad.float(), grad_ref.float(), rtol=tol, atol=tol)


def saved_fp32_numel(fn, *args) -> int:
    """The largest fp32 tensor autograd keeps for the backward of ``fn(*args)``."""
    sizes = [0]

    def pack(t):
        if t.dtype == torch.float32:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return max(sizes)


def test_no_vocab_sized_fp32_tensor_is_kept_for_the_backward():
    logits, ids, temps = inputs(torch.bfloat16, t=65, v=300)
    vocab_sized = 64 * 300
    # what the eager formula keeps
    assert saved_fp32_numel(lp.compute_logprobs, logits, ids, temps) >= vocab_sized
    assert saved_fp32_numel(lp.chunked_logprobs, logits, ids, temps) < vocab_sized
