"""The trainer's full weights off their FSDP2 shards, for every hand-off (files, NCCL): gathered bucket by
bucket in the serving dtype, so no rank ever holds more of the full model than a bucket and each bucket is
one collective, not one per parameter; and the policy export as files (:func:`export_model`) built on it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from asyncrl.models.adapters import is_adapter_name, is_lora_model
from asyncrl.models.hf import TORCH_DTYPES, publish_weights
from asyncrl.transport.weights import export_items

# full (unsharded) bytes gathered in one collective: a decoder layer of the Qwen3-4B shape is ~200 MB in
# bf16, so a bucket holds a couple of layers; a tensor larger than this (the embedding) goes alone
BUCKET_BYTES = 512 << 20


def iter_full(
    model: torch.nn.Module, dtype: torch.dtype | None = None, only: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of what a policy export holds (:func:`export_items`, those whose name passes
    ``only``), on the model's device, in ``dtype`` (``None``: each tensor's own). Under FSDP2 a collective:
    every rank iterates in lockstep and gets every tensor. Each rank casts its shards first (bf16 halves what
    moves)."""
    bucket: list[tuple[str, DTensor]] = []
    size = 0
    for name, tensor in export_items(model):
        if only is not None and not only(name):
            continue
        out = dtype or tensor.dtype
        if not isinstance(tensor, DTensor) or tensor.device_mesh.size() == 1 or not row_sharded(tensor):
            yield from gather_bucket(bucket, dtype)
            bucket, size = [], 0
            yield name, whole(tensor).detach().to(out)
            continue
        nbytes = tensor.numel() * out.itemsize
        if bucket and (
            size + nbytes > BUCKET_BYTES or (dtype is None and bucket[0][1].dtype != tensor.dtype)
        ):
            yield from gather_bucket(bucket, dtype)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    yield from gather_bucket(bucket, dtype)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as one rank holds it whole: a DTensor's local shard on a one-rank mesh (no collective), its
    full_tensor on others (any placement), a plain tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    return tensor.to_local() if tensor.device_mesh.size() == 1 else tensor.full_tensor()


def row_sharded(tensor: DTensor) -> bool:
    """Whether a DTensor is laid out as FSDP2 shards a parameter: dim 0 split over a one-dimensional mesh."""
    return tensor.device_mesh.ndim == 1 and tuple(tensor.placements) == (Shard(0),)


def gather_bucket(
    bucket: list[tuple[str, DTensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of row-sharded DTensors on one mesh, gathered in ``dtype`` (``None``: theirs, all
    alike) with one all-gather.

    FSDP2 splits dim 0 as ``torch.chunk`` does: with ``n`` rows over ``W`` ranks, rank ``r`` holds rows
    ``[r*c, min((r+1)*c, n))``, ``c = ceil(n / W)`` (the last ranks may hold fewer, or none). Each rank lays
    its shards out padded to ``c`` rows, so rank ``r``'s part of the gathered buffer holds every tensor's
    rows of rank ``r`` at the same offsets; a tensor is then its ``W`` parts, concatenated and cut to ``n``
    rows."""
    if not bucket:
        return
    first = bucket[0][1]
    mesh, world, out = first.device_mesh, first.device_mesh.size(), dtype or first.dtype
    layout = []  # (rows, rows per rank, elements per row, offset in a rank's part)
    total = 0
    for _, t in bucket:
        rows, per_row = t.shape[0], math.prod(t.shape[1:])
        chunk = -(-rows // world)
        layout.append((rows, chunk, per_row, total))
        total += chunk * per_row
    send = torch.zeros(total, dtype=out, device=first.to_local().device)
    for (_, _, _, offset), (_, t) in zip(layout, bucket, strict=True):
        local = t.to_local().detach().reshape(-1)
        send[offset : offset + local.numel()].copy_(local)  # casts to the sent dtype
    parts = torch.empty(world * total, dtype=out, device=send.device)
    dist.all_gather_into_tensor(parts, send, group=mesh.get_group())
    parts = parts.view(world, total)
    del send
    for (rows, chunk, per_row, offset), (name, t) in zip(layout, bucket, strict=True):
        full = parts[:, offset : offset + chunk * per_row].reshape(world * chunk, *t.shape[1:])[:rows]
        yield name, full.contiguous()


def full_state_dict(
    fabric,
    model: torch.nn.Module,
    dtype: torch.dtype | None = None,
    only: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor] | None:
    """The unsharded weights (those whose name passes ``only``) as CPU tensors in ``dtype`` (a collective
    under FSDP2; returned on rank 0).

    Gathered bucket by bucket, cast on the GPU before the gather (:func:`iter_full`), then copied to rank 0's
    CPU: casting first halves the bytes that cross NVLink and PCIe and avoids a slow CPU-side cast; the extra
    GPU memory is one bucket.
    """
    rank0 = fabric.global_rank == 0
    out = {}
    for name, full in iter_full(model, dtype, only):
        if rank0:
            out[name] = full.to("cpu")
    return out if rank0 else None


def export_model(fabric, raw_model, tokenizer, path: Path, dtype: str | None = None) -> None:
    """Publish the current policy as an HF directory at ``path`` (atomic, rank 0 writes), in the serving
    ``dtype`` (e.g. bf16: half the bytes for the sidecar to read than the fp32 master weights). A LoRA model
    (peft) publishes its adapters only, in peft's layout (see :mod:`asyncrl.models.adapters`)."""
    lora = is_lora_model(raw_model)
    state = full_state_dict(
        fabric, raw_model, TORCH_DTYPES[dtype] if dtype else None, is_adapter_name if lora else None
    )
    if fabric.global_rank == 0:
        publish_weights(raw_model, tokenizer, path, state_dict=state)
    fabric.barrier()
