"""``weights.transport=filesystem``: the current policy gathered off its shards and written as an HF
directory (``weights/step_N``, :func:`asyncrl.transport.gather.export_model`), which a sidecar of either
backend reloads in place. The default, and the only transport that carries a LoRA adapter (its directory is
what vLLM loads).

Torch-free at import (the config checks read :class:`Files`).
"""

from __future__ import annotations

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


class FilePublisher:
    """``weights.transport=filesystem``: every policy as an HF directory in the serving dtype (a collective:
    every rank calls :meth:`publish`)."""

    def __init__(self, fabric, model: torch.nn.Module, tokenizer, dtype: str):
        self.fabric, self.model, self.tokenizer, self.dtype = fabric, model, tokenizer, dtype

    def publish(self, version: int, path: Path) -> None:
        from asyncrl.transport.gather import export_model  # lazy: torch (the config checks read Files)

        export_model(self.fabric, self.model, self.tokenizer, path, self.dtype)
