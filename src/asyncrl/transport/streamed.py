"""What the streamed transports (nccl, ipc) share on the trainer's side: which versions they send themselves,
and the publisher that sends those and writes the others as files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.checkpoint import is_checkpoint_step, policy_window, protected_weights
from asyncrl.transport.base import WeightPublisher, transport_of

if TYPE_CHECKING:
    from asyncrl.config import Config


def sent_directly(version: int, cfg: Config) -> bool:
    """Whether a streamed transport sends policy ``version`` itself (else the trainer writes safetensors).

    Only what the orchestrator will load during this run and what no checkpoint needs on disk: strict mode
    loads versions ``1 .. max_steps - 1 - async_level``, each exactly once, in order.
    """
    k = cfg.async_level
    last_loaded = policy_window(cfg.max_steps - 1, k).start  # what the run's last step samples from
    if not transport_of(cfg).streamed or not 1 <= version <= last_loaded:
        return False
    checkpoints = [
        s for s in range(1, cfg.max_steps + 1) if is_checkpoint_step(s, cfg.ckpt.interval, cfg.max_steps)
    ]
    return version not in protected_weights(checkpoints, k)


@dataclass
class StreamedOrFiles:
    """A streamed transport's publisher for the versions it may send, files for the rest."""

    cfg: Config
    streamed: WeightPublisher
    files: WeightPublisher

    def publish(self, version: int, path: Path) -> None:
        (self.streamed if sent_directly(version, self.cfg) else self.files).publish(version, path)
