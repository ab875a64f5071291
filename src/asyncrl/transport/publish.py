"""How the trainer publishes each new policy as ``weights/step_N``, chosen once at start by ``weights.transport``:
:func:`build_publisher` returns one :class:`WeightPublisher`, and the training loop calls its ``publish`` once a step.

``filesystem`` writes every version as files (:mod:`asyncrl.transport.files`). ``nccl`` and ``ipc`` send the
versions the orchestrator will load GPU to GPU (:func:`asyncrl.transport.nccl.sent_directly`) and write the
others, which a checkpoint needs on disk or no sidecar will ever receive, as files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from asyncrl.config import Config
from asyncrl.models.hf import TORCH_DTYPES
from asyncrl.transport.files import FilePublisher
from asyncrl.transport.ipc import IPCSender
from asyncrl.transport.nccl import NCCLSender, export_entries, sent_directly, write_manifest

log = logging.getLogger("asyncrl.trainer")


class WeightPublisher(Protocol):
    def publish(self, version: int, path: Path) -> None:
        """Make the model's current weights policy ``version`` at ``path``; every trainer rank calls it, and it
        returns once the policy may change again."""


class NCCLPublisher:
    """``weights.transport=nccl``: the manifest in ``path``, then one broadcast into the sidecars' GPUs."""

    def __init__(self, cfg: Config, fabric, model: torch.nn.Module):
        log.info(f"opening the NCCL group at {cfg.weights.nccl_host}:{cfg.weights.nccl_port} (waits for the sidecars)")
        self.rank0, self.model, self.reload = fabric.global_rank == 0, model, cfg.weights.reload
        self.dtype = TORCH_DTYPES[cfg.model.dtype]
        self.sender = NCCLSender(cfg, fabric.global_rank)
        self.entries = export_entries(model, self.dtype)

    def publish(self, version: int, path: Path) -> None:
        if self.rank0:  # manifest first: the orchestrator's relay starts the receive
            write_manifest(path, self.entries, version, self.reload)
        self.sender.send(self.model, self.dtype)  # returns once the sidecars have it


class IPCPublisher:
    """``weights.transport=ipc``: one process on the sidecar's GPU (``config.root`` checks), whose buffer the
    sidecar copies each policy from."""

    def __init__(self, cfg: Config, model: torch.nn.Module):
        self.model, self.timeout_s = model, cfg.trainer.wait_timeout_s
        self.sender = IPCSender(model, TORCH_DTYPES[cfg.model.dtype], cfg.weights.reload)

    def publish(self, version: int, path: Path) -> None:
        self.sender.send(self.model, path, version, self.timeout_s)  # returns once the sidecar copied it


@dataclass
class StreamedOrFiles:
    """A streamed transport for the versions it may send directly, files for the rest."""

    cfg: Config
    streamed: WeightPublisher
    files: WeightPublisher

    def publish(self, version: int, path: Path) -> None:
        (self.streamed if sent_directly(version, self.cfg) else self.files).publish(version, path)


def build_publisher(cfg: Config, fabric, model: torch.nn.Module, tokenizer) -> WeightPublisher:
    """The publisher of ``weights.transport`` for ``model`` (the raw model, not Fabric's wrapper)."""
    files = FilePublisher(fabric, model, tokenizer, cfg.model.dtype)
    transport = cfg.weights.transport
    if transport == "filesystem":
        return files
    if transport == "nccl":
        return StreamedOrFiles(cfg, NCCLPublisher(cfg, fabric, model), files)
    if transport == "ipc":
        return StreamedOrFiles(cfg, IPCPublisher(cfg, model), files)
    raise ValueError(f"weights.transport={transport!r} is not allowed; allowed values: 'filesystem', 'nccl', 'ipc'")
