"""``attn_implementation="varlen"``: packed-row attention on torch's own flash kernel, no flash-attn wheel.

A packed row holds several samples whose ``position_ids`` restart at 0. With ``sdpa`` transformers
materialises an ``[L, L]`` block-diagonal mask and the attention costs ``L^2`` per row; flash-attn's varlen
kernel costs ``sum(len_i^2)`` but the ``flash-attn`` package needs CUDA to build (and a network for prebuilt
wheels). ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10) exposes the same kernel: this module
registers it with transformers under the name ``varlen``, taking sequence boundaries from ``position_ids``.
Rows of one micro-batch are flattened into one token stream, so any number of rows works. GPU only (the
kernel is CUDA's); CPU runs keep ``sdpa``. ``varlen_fa4`` is the same glue on flash-attn-4's kernel
(models/fa4.py), the faster one on Hopper.
"""

from __future__ import annotations

import inspect
import weakref
from importlib import metadata
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from asyncrl.models.fa4 import packed_attention_fa4

NAME = "varlen"
FA4 = "varlen_fa4"
_registered = False


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn  # lazy: torch>=2.10 only, on GPU
    except ImportError as e:  # torch < 2.10
        raise RuntimeError(
            f"model.attn_implementation=varlen needs torch >= 2.10 (torch {torch.__version__})"
        ) from e
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


_cache: dict = {}


def _boundaries(position_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    """``cu_seqlens_from_positions`` once per forward pass: every layer gets the same position_ids tensor,
    and computing the maximum is a host sync that would otherwise stall the GPU in each layer."""
    # Identity through a weak reference: a data_ptr key could match a new tensor allocated where a freed
    # one was (the next micro-batch), and give it the previous micro-batch's boundaries.
    ref = _cache.get("ref")
    if ref is None or ref() is not position_ids or _cache["key"] != (position_ids._version, rows):
        _cache.update(
            ref=weakref.ref(position_ids),
            key=(position_ids._version, rows),
            value=cu_seqlens_from_positions(position_ids.expand(rows, -1)),
        )
    return _cache["value"]


def takes_packed_kwargs(implementation: str | None) -> bool:
    """Whether a model with this ``attn_implementation`` takes :func:`packed_kwargs`: asyncrl's ``varlen``
    and transformers' flash paths (flash-attn 2, 3 and 4). Those need them for more than one row per forward:
    without them transformers 5.17 treats a batch of several rows as packed only with ``batch_size == 1``
    (``_is_packed_sequence``), so samples of a row would attend across their boundaries; and for one row it
    derives the boundaries from ``position_ids`` again in every layer, a host sync each."""
    return implementation in (NAME, FA4) or (implementation or "").startswith("flash_attention_")


def packed_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """The sequence boundaries of packed rows ``[B, L]`` as transformers' attention kwargs (the names its
    flash paths take), for a forward to compute them once instead of each layer: inside a ``torch.compile``'d
    layer, :func:`_boundaries`' cache and host sync would split the graph."""
    cu, max_len = cu_seqlens_from_positions(position_ids)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sequence starts (int32, with the total at the end) and the longest sequence, for the
    rows of ``position_ids`` ``[B, L]`` laid end to end (each row begins a sequence at position 0)."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0, as_tuple=False).flatten()
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def per_sample_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of each sample of a packed stream on its own, one ``scaled_dot_product_attention``
    per sample (any device and dtype, differentiable; key/value heads repeated for their query heads): the
    CPU path of :func:`packed_attention`, and in fp32 the reference its GPU kernels are checked against."""
    hq, hkv = q.shape[1], k.shape[1]
    bounds = cu.tolist()
    k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)

    def one(a: int, b: int) -> torch.Tensor:
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    return torch.cat([one(a, b).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:], strict=False)])


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of a packed token stream: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (fp16/bf16, CUDA),
    samples delimited by ``cu`` (:func:`cu_seqlens_from_positions`) -> ``[T, Hq, D]``. On the CPU (tests),
    :func:`per_sample_attention`."""
    if not q.is_cuda:
        return per_sample_attention(q, k, v, cu, scale)
    hq, hkv = q.shape[1], k.shape[1]
    fn, params = _varlen_fn()
    extra: dict[str, Any] = {}
    if hkv != hq:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # torch 2.10/2.11: expand the shared key/value heads
            k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    if scale is not None and "scale" in params:
        extra["scale"] = scale
    if "is_causal" in params:
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    return fn(q, k, v, cu, cu, max_len, max_len, **extra)


def varlen_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, kernel=None, **kwargs
):
    """transformers attention interface: q ``[B, Hq, L, D]``, k/v ``[B, Hkv, L, D]`` -> ``[B, L, Hq, D]``, on
    ``kernel`` (``packed_attention``'s contract; default torch's varlen kernel)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError("varlen attention needs position_ids (packed rows restart them at 0 per sample)")
    # The flash kernel takes fp16/bf16 only. Under autocast (Fabric bf16-mixed) q/k arrive in fp32, promoted
    # by RoPE's fp32 cos/sin; sdpa is on autocast's cast list, this custom op is not, so cast here.
    dtype = (
        torch.get_autocast_dtype(query.device.type)
        if torch.is_autocast_enabled(query.device.type)
        else value.dtype
    )
    if query.is_cuda and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"varlen attention runs in fp16/bf16, got {dtype}: use precision bf16-mixed or a bf16 model"
        )
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    b, hq, length, d = query.shape
    hkv = key.shape[1]
    q = query.transpose(1, 2).reshape(b * length, hq, d)
    k = key.transpose(1, 2).reshape(b * length, hkv, d)
    v = value.transpose(1, 2).reshape(b * length, hkv, d)
    if kwargs.get("cu_seq_lens_q") is not None:  # computed once per forward by the caller (packed_kwargs)
        cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    else:
        cu, max_len = _boundaries(position_ids, b)
    out = (kernel or packed_attention)(q, k, v, cu, max_len, scaling)
    return out.reshape(b, length, hq, d), None


def varlen_fa4_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """:func:`varlen_attention` on flash-attn-4's kernel, as compile-friendly custom ops (models/fa4.py)."""
    return varlen_attention(
        module, query, key, value, attention_mask, scaling, dropout, packed_attention_fa4, **kwargs
    )


def register() -> None:
    """Make ``attn_implementation="varlen"`` and ``"varlen_fa4"`` known to transformers (idempotent)."""
    global _registered
    if _registered:
        return
    for name, fn in ((NAME, varlen_attention), (FA4, varlen_fa4_attention)):
        AttentionInterface.register(name, fn)
        # boundaries from position_ids
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, lambda *args, **kwargs: None)
    _registered = True


AUTO = "auto"


def resolve(
    name: str, device: torch.device | str | None, training: bool = True, context_parallel: int = 1
) -> str:
    """The kernel ``model.attn_implementation`` names for a model about to run on ``device`` (``None``: CUDA
    when there is one). ``auto`` is the fastest this process can run: ``varlen_fa4`` for training on a Hopper
    or newer GPU with flash-attn-4 installed (1.20x ``varlen`` in the 4B trainer at 8,000-token samples:
    ``python benchmarks/trainer_mfu.py --shape 4b --row-lens 16384 --sample-len 8000 --attn varlen
    varlen_fa4 --ac 2 --rows 8 --compile 1``),
    ``varlen`` on other GPUs, ``sdpa`` on the CPU, under context parallelism (torch's ring attention replaces
    SDPA's kernels) and for decoding in the built-in sidecar (the varlen paths keep no KV cache). Resolved in
    the process that loads the model, since the trainer may run in an environment of its own."""
    if name != AUTO:
        return name
    dev = torch.device(device) if device is not None else None
    on_gpu = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
    if not on_gpu or not training or context_parallel > 1:
        return "sdpa"
    if torch.cuda.get_device_capability(dev)[0] >= 9 and fa4_installed():
        return FA4
    return NAME


def fa4_installed() -> bool:
    """Whether flash-attn-4 is installed (its distribution's metadata: importing its kernels takes
    seconds)."""
    try:
        metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        return False
    return True
