import pytest
from transformers import Qwen3Config

from asyncrl.trainer.perf import flops_per_token, matmul_params, mfu


def qwen3_06b():
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )


def test_matmul_params_of_qwen3_0_6b():
    # per layer: q 1024x2048, k/v 1024x1024 each, o 2048x1024, MLP 3x1024x3072; plus lm_head 151936x1024
    per_layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072
    assert matmul_params(qwen3_06b()) == 28 * per_layer + 151936 * 1024


def test_conventions_and_mfu():
    cfg = qwen3_06b()
    assert flops_per_token(cfg, 8192) == 6 * matmul_params(cfg)
    extra = flops_per_token(cfg, 8192, "prime_rl") - flops_per_token(cfg, 8192)
    assert extra == 12 * 28 * 16 * 64 * 8192
    # 40k tokens/s on one H100: 40e3 * 6N / 989e12
    assert mfu(40e3, cfg, 8192, "NVIDIA H100 80GB HBM3") == pytest.approx(40e3 * 6 * matmul_params(cfg) / 989e12)
    with pytest.raises(ValueError):
        mfu(1.0, cfg, 1, "Some GPU")
