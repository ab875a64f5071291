import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from asyncrl.trainer.perf import (
    attention_flops,
    batch_lengths,
    matmul_params,
    mfu,
    mfu_at,
    mfu_metrics,
    prime_rl_flops_per_token,
    sample_lengths,
    step_flops,
)

H100 = "NVIDIA H100 80GB HBM3"


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


def test_a_mixture_of_experts_counts_the_experts_a_token_runs_and_the_router():
    cfg = Qwen3MoeConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, intermediate_size=128, mlp_only_layers=[1])  # fmt: skip
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64
    sparse, dense = 3 * 64 * 32 * 2 + 64 * 8, 3 * 64 * 128
    assert matmul_params(cfg) == 4 * attn + 3 * sparse + dense + 1000 * 64


def test_causal_attention_counts_the_pairs_a_mask_keeps():
    cfg = Qwen3Config(num_hidden_layers=3, num_attention_heads=4, hidden_size=64, head_dim=32)
    lengths = [300, 1200]
    # (query, key) pairs a causal mask keeps
    pairs = sum(int(torch.ones(n, n).tril().sum()) for n in lengths)
    by_pairs = 3 * 4 * 32 * pairs * 2 * 2 * 3  # two products, a multiply-add each, x3 with the backward
    assert attention_flops(cfg, lengths) == pytest.approx(by_pairs, rel=2e-3)  # L^2/2 for L(L+1)/2
    # a row of two samples is half the attention of one sample twice as long
    assert attention_flops(cfg, [800, 800]) == attention_flops(cfg, [1600]) / 2
    flops = step_flops(cfg, lengths)
    assert flops["attn"] - flops["6n"] == attention_flops(cfg, lengths)
    assert flops["6n"] == 6 * matmul_params(cfg) * 1500


def test_mfu_both_ways_and_prime_rls_count():
    cfg = qwen3_06b()
    # 40k tokens/s on one H100 in samples of 8,192 tokens
    m = mfu_at(cfg, [8192], 40e3, H100)
    assert m["mfu_6n"] == pytest.approx(40e3 * 6 * matmul_params(cfg) / 989e12)
    assert m["mfu_attn"] == pytest.approx(
        40e3 * (6 * matmul_params(cfg) + 6 * 28 * 16 * 128 * 8192) / 989e12
    )
    # PRIME-RL's count: non-causal, over the row, with hidden / heads (64) where Qwen3's head_dim is 128
    assert prime_rl_flops_per_token(cfg, 8192) - 6 * matmul_params(cfg) == 12 * 28 * 16 * 64 * 8192
    assert mfu(989e12, 2.0, "NVIDIA H200", 2) == pytest.approx(0.25)
    assert mfu(756e12, 1.0, "NVIDIA H100 PCIe") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="known"):
        mfu(1.0, 1.0, "Some GPU")


def test_sample_lengths_from_packed_positions():
    rows = np.array([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    assert sample_lengths(rows) == [3, 2, 4, 6, 3]
    assert sample_lengths(np.array([5, 6, 0, 1])) == [2, 2]  # a shard that starts inside a sample
    mbs = [{"position_ids": torch.tensor(rows)}, {"position_ids": np.array([[0, 1, 0]])}]
    assert batch_lengths(mbs) == [3, 2, 4, 6, 3, 2, 1]


def test_step_metrics_only_where_the_peak_is_known():
    flops = {"6n": 989e12, "attn": 2 * 989e12}
    assert mfu_metrics("train", flops, 1.0, H100, 2) == {"train/mfu_6n": 0.5, "train/mfu_attn": 1.0}
    assert mfu_metrics("train", flops, 1.0, None, 1) == {}  # a CPU
    assert mfu_metrics("sft", flops, 1.0, "Some GPU", 1) == {}


def test_the_trainers_step_row_carries_its_mfu_both_ways(monkeypatch):
    from types import SimpleNamespace

    from asyncrl.trainer import loop

    cfg = qwen3_06b()
    mbs = [
        {
            "input_ids": torch.zeros(1, 9, dtype=torch.long),
            "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]),
        }
    ]
    fabric = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    flops = loop.all_flops(fabric, cfg, mbs, 1)
    assert flops == step_flops(cfg, [3, 2, 4])
    rows = []
    monitor = SimpleNamespace(log=lambda row, step: rows.append(row))
    scheduler = SimpleNamespace(get_last_lr=lambda: [1e-6])
    sums = {"loss": 0.1, "grad_norm": 1.0, "tokens": 9.0}
    meta = {"loss_tokens": 9, "policy_versions": [0]}
    times = {"time/train_s": 2.0}
    loop.log_step(
        monitor, fabric, scheduler, 0, sums, kl_metrics={}, times=times, mbs=mbs, meta=meta, flops=flops
    )
    assert not any("mfu" in k for k in rows[0])  # a CPU: no peak to measure against
    monkeypatch.setattr(loop, "gpu_name", lambda device: H100)
    loop.log_step(
        monitor, fabric, scheduler, 0, sums, kl_metrics={}, times=times, mbs=mbs, meta=meta, flops=flops
    )
    assert rows[1]["train/mfu_6n"] == pytest.approx(flops["6n"] / (2.0 * 989e12))
    assert rows[1]["train/mfu_attn"] == pytest.approx(flops["attn"] / (2.0 * 989e12))
