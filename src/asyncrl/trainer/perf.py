"""Training FLOPs and MFU (pure functions).

Two conventions, reported side by side:
- ``matmul``: ``6 * N`` per token, N = parameters in matrix multiplies (attention and MLP projections,
  lm_head; not the embedding lookup, nor norms). Conservative: attention scores are not counted.
- ``prime_rl``: PRIME-RL's ``trainer/perf.py``: ``6 * N + 12 * layers * heads * (hidden / heads) * T`` with
  T the packed row length, so its figures (26.8% MFU for Qwen3-0.6B on one H100) can be compared.
"""

from __future__ import annotations

# dense bf16 peak, vendor datasheets (H100 SXM and H200 share the compute die)
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def matmul_params(cfg) -> int:
    """Parameters that take part in matrix multiplies per token (an HF decoder config)."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    d = getattr(cfg, "head_dim", None) or h // heads
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    mlp = 3 * h * inter
    return layers * (attn + mlp) + cfg.vocab_size * h


def flops_per_token(cfg, row_len: int, convention: str = "matmul") -> float:
    """Forward + backward FLOPs per trained token."""
    base = 6.0 * matmul_params(cfg)
    if convention == "matmul":
        return base
    if convention == "prime_rl":
        return (
            base
            + 12.0
            * cfg.num_hidden_layers
            * cfg.num_attention_heads
            * (cfg.hidden_size // cfg.num_attention_heads)
            * row_len
        )
    raise ValueError(f"convention={convention!r}; allowed: 'matmul', 'prime_rl'")


def peak_flops(device_name: str) -> float:
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    raise ValueError(f"no peak FLOP/s known for {device_name!r}; known: {sorted(PEAK_BF16_FLOPS)}")


def mfu(
    tokens_per_s: float, cfg, row_len: int, device_name: str, world_size: int = 1, convention: str = "matmul"
) -> float:
    return tokens_per_s * flops_per_token(cfg, row_len, convention) / (peak_flops(device_name) * world_size)
