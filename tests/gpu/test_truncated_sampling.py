"""Top-k / top-p / min-p with the vLLM sidecar: the trainer scores each token under the truncated,
renormalised distribution vLLM sampled it from (asyncrl.models.truncation). Run: pytest -m gpu
tests/gpu/test_truncated_sampling.py
"""

from __future__ import annotations

import pytest

from gpu.conftest import record
from gpu.test_gpu import rl_with_vllm

pytestmark = pytest.mark.gpu


def test_bitwise_mode_holds_under_top_p(gpu_setup, tmp_path):
    """numerics=bitwise with top_p 0.9: the trainer finds the sampler's kept set in the same processed
    logits, so its logprobs equal vLLM's bit for bit and mismatch_kl is exactly 0 on-policy, every step."""
    _, train = rl_with_vllm(
        gpu_setup,
        tmp_path / "rl",
        "numerics=bitwise",
        "orchestrator.top_p=0.9",
        "max_steps=3",
        "async_level=0",
        "trainer.optim.lr=3e-4",
    )
    mismatch = [r["train/mismatch_kl"] for r in train]
    outside = [r["train/truncation_outside_frac"] for r in train]
    record("bitwise_top_p0.9_mismatch_kl", mismatch)
    record("bitwise_top_p0.9_truncation_outside_frac", outside)
    assert mismatch == [0.0] * 3 and outside == [0.0] * 3


def test_exact_ratios_under_truncation_against_the_biased_ones(gpu_setup, tmp_path):
    """bf16 (numerics=fast), all three truncations: at step 0 scoring the truncated distribution leaves bf16
    noise; scoring the full one adds the log of the kept mass to every token's ratio."""
    cut = ["orchestrator.top_p=0.9", "orchestrator.top_k=20", "orchestrator.min_p=0.05", "max_steps=1"]
    _, exact = rl_with_vllm(gpu_setup, tmp_path / "exact", *cut)
    _, biased = rl_with_vllm(gpu_setup, tmp_path / "biased", *cut, "trainer.loss.truncated_logprobs=false")
    record(
        "vllm_truncated_step0_mismatch_kl",
        {"exact": exact[0]["train/mismatch_kl"], "biased": biased[0]["train/mismatch_kl"]},
    )
    record("vllm_truncated_step0_outside_frac", exact[0]["train/truncation_outside_frac"])
    assert exact[0]["train/mismatch_kl"] < 1e-2
    assert biased[0]["train/mismatch_kl"] > 3 * exact[0]["train/mismatch_kl"]
    assert exact[0]["train/truncation_outside_frac"] < 0.01
