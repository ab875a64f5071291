"""What the streamed transports share on the trainer's side: which versions they send themselves, the
publisher that sends those and writes the others as files, and the columns of the manifest that describes
what they send."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.checkpoint import is_checkpoint_step, policy_window, protected_weights
from asyncrl.transport.base import WeightPublisher, transport_of
from asyncrl.transport.weights import export_items

if TYPE_CHECKING:
    import torch

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


def export_entries(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype name, full shape)`` of each tensor a streamed transport sends (in ``dtype``), in the
    order :func:`asyncrl.transport.weights.export_items` yields them."""
    return [(name, str(dtype).removeprefix("torch."), list(t.shape)) for name, t in export_items(model)]


def manifest_columns(entries: list[tuple[str, str, list[int]]]) -> dict[str, list]:
    """:func:`export_entries` as a manifest's ``names``, ``dtype_names`` and ``shapes`` (vLLM's field
    names)."""
    names, dtypes, shapes = (list(x) for x in zip(*entries, strict=True)) if entries else ([], [], [])
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}
