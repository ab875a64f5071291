"""Training FLOPs and MFU (pure functions), counted two ways and always reported side by side:

- **by 6·N** (``mfu_6n``): ``6 * N`` FLOPs per trained token, N the parameters that take part in matrix
  multiplies (the attention and MLP projections, the active experts of a mixture of experts, its router,
  lm_head; not the embedding lookup, nor norms). The usual count, and the conservative one: attention's own
  work is left out.
- **counting causal attention** (``mfu_attn``): 6·N plus Q·Kᵀ and the weights times V over each sample's
  causal mask, forward and backward (:func:`attention_flops`). Its share grows with the sample's length: at
  8,000-token samples of the Qwen3-4B shape it adds 29% to 6·N, work that 6·N does not see.

Both count every token of the packed rows, padding included, as the tokens/s beside them do. PRIME-RL's
``trainer/perf.py`` adds ``12 * layers * heads * (hidden / heads) * T`` per token with T the packed row's
length (:func:`prime_rl_flops_per_token`): not causal, and over the row rather than the sample, so with many
samples a row it counts more than the kernels do; it is kept only to compare with figures published that way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

# dense bf16 peak FLOP/s without sparsity, vendor datasheets; the first name found in the device's wins
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _sparse(cfg, layer: int) -> bool:
    """Whether decoder layer ``layer`` of an HF config runs experts (Qwen3-MoE's rule) rather than a dense
    MLP."""
    if not getattr(cfg, "num_experts", 0):
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(cfg, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


def matmul_params(cfg) -> int:
    """Parameters that take part in matrix multiplies per token (an HF decoder config); of a mixture of
    experts, the experts each token is routed to and the router."""
    h, layers, heads = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads
    kv, d = getattr(cfg, "num_key_value_heads", heads), _head_dim(cfg)
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    total = cfg.vocab_size * h
    for layer in range(layers):
        if _sparse(cfg, layer):
            mlp = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + h * cfg.num_experts
        else:
            mlp = 3 * h * cfg.intermediate_size
        total += attn + mlp
    return total


def attention_flops(cfg, lengths: Iterable[int]) -> float:
    """Causal attention's forward + backward FLOPs over samples of ``lengths`` tokens. Per sample, layer and
    head, Q·Kᵀ and the weights times V over a causal mask cost 2·head_dim·L² forward (L²/2 pairs, 2 products
    of 2·head_dim FLOPs), three times that with the backward."""
    squares = sum(int(n) * int(n) for n in lengths)
    return 6.0 * cfg.num_hidden_layers * cfg.num_attention_heads * _head_dim(cfg) * squares


def prime_rl_flops_per_token(cfg, row_len: int) -> float:
    """PRIME-RL's count per token (see the module doc): 6·N plus non-causal attention over the packed row."""
    heads = cfg.num_attention_heads
    return (
        6.0 * matmul_params(cfg)
        + 12.0 * cfg.num_hidden_layers * heads * (cfg.hidden_size // heads) * row_len
    )


def sample_lengths(position_ids: Sequence | np.ndarray) -> list[int]:
    """The lengths of the samples packed in rows whose positions restart at 0 for each sample (asyncrl's
    packing: ``position_ids`` of shape ``[rows, row_len]`` or one row; padding forms a sample of its own)."""
    pos = np.asarray(position_ids)
    pos = pos.reshape(-1, pos.shape[-1]) if pos.ndim else pos.reshape(1, 1)
    lengths: list[int] = []
    for row in pos:
        starts = np.flatnonzero(row == 0)
        # a row that does not start a sample (a context-parallel shard)
        if not len(starts) or starts[0] != 0:
            starts = np.concatenate(([0], starts))
        lengths.extend(np.diff(np.append(starts, len(row))).tolist())
    return lengths


def step_flops(cfg, lengths: Sequence[int]) -> dict[str, float]:
    """The FLOPs of training on samples of ``lengths`` tokens, both ways: ``{"6n": ..., "attn": ...}``
    (``attn`` is 6·N's count plus causal attention's)."""
    six_n = 6.0 * matmul_params(cfg) * sum(lengths)
    return {"6n": six_n, "attn": six_n + attention_flops(cfg, lengths)}


def peak_flops(device_name: str) -> float:
    """The device's dense bf16 peak FLOP/s (:data:`PEAK_BF16_FLOPS`); ``ValueError`` naming the known
    ones."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    raise ValueError(f"no peak FLOP/s known for {device_name!r}; known: {sorted(PEAK_BF16_FLOPS)}")


def mfu(flops: float, seconds: float, device_name: str, devices: int = 1) -> float:
    """The share of ``devices`` x the device's peak that ``flops`` done in ``seconds`` make."""
    return flops / (max(seconds, 1e-12) * peak_flops(device_name) * devices)


def mfu_of(flops: dict[str, float], seconds: float, device_name: str, devices: int = 1) -> dict[str, float]:
    """``{"mfu_6n": ..., "mfu_attn": ...}`` of a step's ``flops`` (:func:`step_flops`) done in
    ``seconds``."""
    return {f"mfu_{k}": mfu(v, seconds, device_name, devices) for k, v in flops.items()}


def mfu_at(
    cfg, lengths: Sequence[int], tokens_per_s: float, device_name: str, devices: int = 1
) -> dict[str, float]:
    """:func:`mfu_of` training at ``tokens_per_s`` (over all ``devices``) on samples of ``lengths`` tokens,
    each step alike (the benchmarks' fixed rows)."""
    return mfu_of(step_flops(cfg, lengths), sum(lengths) / tokens_per_s, device_name, devices)


def batch_lengths(mbs: Iterable) -> list[int]:
    """:func:`sample_lengths` over micro-batches (``position_ids`` as numpy arrays or CPU tensors)."""
    return [n for mb in mbs for n in sample_lengths(np.asarray(mb["position_ids"]))]


def gpu_name(device) -> str | None:
    """The name of ``device`` (a ``torch.device``) if it is a GPU (its peak FLOP/s is looked up by it), else
    None."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch  # lazy: the rest of this module is arithmetic, and only a GPU's name needs torch

    return torch.cuda.get_device_name(device)


def mfu_metrics(
    prefix: str, flops: dict[str, float], seconds: float, device_name: str | None, devices: int
) -> dict[str, float]:
    """:func:`mfu_of` as a step's metrics, ``<prefix>/mfu_6n`` and ``<prefix>/mfu_attn``; none on a device
    whose peak is not known (``device_name=None``: not a GPU)."""
    try:
        return {f"{prefix}/{k}": v for k, v in mfu_of(flops, seconds, device_name or "", devices).items()}
    except ValueError:  # peak_flops: a CPU, or a GPU of unknown peak
        return {}
