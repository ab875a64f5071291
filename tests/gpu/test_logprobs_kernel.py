"""inference.vllm.logprobs_kernel on the GPU: the one-kernel sampled-token logprobs are vLLM 0.26's
``compute_topk_scores`` numbers to the bit (ids, logprob bits, ranks), over real-vocabulary and odd widths,
bf16 and fp32 logits, rows masked as top-k / top-p leave them, and after the copy to the host. Run: pytest -m
gpu tests/gpu/test_logprobs_kernel.py"""

from __future__ import annotations

import numpy as np
import pytest

from gpu.conftest import record

pytestmark = pytest.mark.gpu


def rows(generator, batch: int, vocab: int, dtype, masked: bool):
    """Logits of a trained model's spread (scale 6, a few outliers), some rows masked to their top 20 as the
    sampler's processed logits are, and a token sampled from each row."""
    import torch

    logits = torch.randn(batch, vocab, generator=generator, device="cuda") * 6
    logits[:, :3] += 12  # peaked rows: the sampled token is often the first-ranked
    if masked:
        cut = logits.topk(min(20, vocab), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < cut, float("-inf"))
    logits = logits.to(dtype)
    sampled = torch.multinomial(logits.float().softmax(-1), 1, generator=generator).view(-1)
    return logits.contiguous(), sampled


def test_logprobs_kernel_equals_vllms():
    import torch
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    from asyncrl.inference.vllm.sampled import sampled_logprobs

    generator = torch.Generator(device="cuda").manual_seed(0)
    cases, differing = 0, []
    for vocab in (151936, 151669, 32000, 1000, 257, 5):
        for batch in (1, 7, 256):
            for dtype in (torch.float32, torch.bfloat16):
                for masked in (False, True):
                    logits, sampled = rows(generator, batch, vocab, dtype, masked)
                    theirs = compute_topk_scores(logits, 0, sampled)
                    ours = sampled_logprobs(logits, sampled, LogprobsTensors)
                    on_host = ours.to_cpu_nonblocking()
                    torch.cuda.synchronize()
                    a, b, c = (x.cpu().numpy() for x in theirs[:3])
                    x, y, z = on_host.tolists()[:3]
                    same = (
                        np.array_equal(a, x)
                        and b.view(np.int32).tobytes() == y.view(np.int32).tobytes()
                        and np.array_equal(c, z)
                        and np.array_equal(b, ours.logprobs.cpu().numpy())
                    )
                    cases += 1
                    if not same:
                        differing.append((vocab, batch, str(dtype), masked))
    record("logprobs_kernel_vs_vllm", {"cases": cases, "differing": differing})
    assert not differing, differing


def test_logprobs_kernel_leaves_wider_requests_to_vllm():
    """A step asking for top-k logprobs too goes to vLLM's function: what the wrapper returns is vLLM's
    own."""
    import importlib

    import torch

    from asyncrl.inference.vllm import sampled

    module = importlib.import_module(sampled.SAMPLER)
    original = module.compute_topk_scores
    sampled.install()
    try:
        logits, ids = rows(torch.Generator(device="cuda").manual_seed(1), 8, 151936, torch.float32, False)
        wide = module.compute_topk_scores(logits, 3, ids, None)
        assert type(wide).__name__ == "LogprobsTensors" and wide.logprobs.shape == (8, 4)
        narrow = module.compute_topk_scores(logits, 0, ids, None)
        assert type(narrow).__name__ == "PackedLogprobs" and narrow.logprobs.shape == (8, 1)
        assert torch.equal(narrow.logprobs, original(logits, 0, ids).logprobs)
    finally:
        module.compute_topk_scores = original
        module._asyncrl_logprobs_kernel = False
