"""``weights.transport=filesystem``: the current policy gathered off its shards and written as an HF
directory (``weights/step_N``, :mod:`asyncrl.transport.weights`), which a sidecar of either backend reloads
in place. The default, and the only transport that carries a LoRA adapter (its directory is what vLLM loads).

Torch-free at import (the config checks read :class:`Files`); the trainer's functions import torch when
called.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.transport.base import Transport

if TYPE_CHECKING:
    import torch

    from asyncrl.config import Config


class Files(Transport):
    """Every policy as files: the :class:`Transport` defaults and a publisher of files."""

    name = "filesystem"
    adapters = True

    @classmethod
    def publisher(cls, cfg: Config, fabric: Any, model: Any, tokenizer: Any) -> FilePublisher:
        return FilePublisher(fabric, model, tokenizer, cfg.model.dtype)


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
    from asyncrl.transport.gather import iter_full  # lazy: torch (the config checks import this module)

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
    # lazy: torch (the config checks import this module)
    from asyncrl.models.adapters import is_adapter_name, is_lora_model
    from asyncrl.models.hf import TORCH_DTYPES, publish_weights  # lazy: torch

    lora = is_lora_model(raw_model)
    state = full_state_dict(
        fabric, raw_model, TORCH_DTYPES[dtype] if dtype else None, is_adapter_name if lora else None
    )
    if fabric.global_rank == 0:
        publish_weights(raw_model, tokenizer, path, state_dict=state)
    fabric.barrier()


class FilePublisher:
    """``weights.transport=filesystem``: every policy as an HF directory in the serving dtype (a collective:
    every rank calls :meth:`publish`)."""

    def __init__(self, fabric, model: torch.nn.Module, tokenizer, dtype: str):
        self.fabric, self.model, self.tokenizer, self.dtype = fabric, model, tokenizer, dtype

    def publish(self, version: int, path: Path) -> None:
        export_model(self.fabric, self.model, self.tokenizer, path, self.dtype)
