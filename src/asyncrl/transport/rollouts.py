"""``rollouts/step_N/``: one step's packed micro-batches and the metadata the trainer checks.

Layout: ``mb_<i>.safetensors`` (arrays of :data:`asyncrl.rollouts.packing.MICRO_BATCH_KEYS`, each
``[rows, length]``; a mixture of experts' ``routed_experts``, int16 ``[rows, length, MoE layers, top_k]``)
and ``meta.json`` (step, policy versions, counts). The writer needs only numpy, so the orchestrator never
imports torch; rank ``r`` of ``w`` trainer ranks reads micro-batches ``r, r+w, ...``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from asyncrl.utils.atomic import atomic_dir


def write_rollouts(path: Path, micro_batches: list[dict[str, np.ndarray]], meta: dict[str, Any]) -> None:
    with atomic_dir(path) as tmp:
        for i, mb in enumerate(micro_batches):
            save_file({k: np.ascontiguousarray(v) for k, v in mb.items()}, str(tmp / f"mb_{i}.safetensors"))
        (tmp / "meta.json").write_text(
            json.dumps({**meta, "num_micro_batches": len(micro_batches)}, indent=2)
        )


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())


def read_rollouts(
    path: Path, rank: int = 0, world_size: int = 1, device: str = "cpu"
) -> tuple[list[dict], dict]:
    """This rank's micro-batches as torch tensors, and the step's metadata."""
    from safetensors.torch import load_file  # lazy: the orchestrator writes rollouts without importing torch

    meta = read_meta(path)
    mbs = [
        load_file(str(path / f"mb_{i}.safetensors"), device=device)
        for i in range(rank, meta["num_micro_batches"], world_size)
    ]
    return mbs, meta
