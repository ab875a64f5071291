"""One monitor interface for all metrics: a line-buffered JSONL sink is always on, W&B is optional.

Keys are namespaced (``train/loss``, ``rollout/reward_mean``, ``async/staleness``). Tests and the
launcher's progress line read the JSONL files, never stdout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from asyncrl.config.sections import MonitorConfig

log = logging.getLogger(__name__)


class Monitor(ABC):
    @abstractmethod
    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record ``metrics`` (namespaced keys) at ``step``."""

    def close(self) -> None:  # noqa: B027 -- optional: a sink without resources has nothing to close
        pass


class JsonlMonitor(Monitor):
    """Appends one JSON object per ``log`` call. On resume from step S, rows of steps >= S (written
    after the checkpoint by the interrupted run) are dropped first, so each step appears once."""

    def __init__(self, path: Path, resume_step: int | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:  # a no-op after the launcher's reconcile; needed when started on its own
            truncate_jsonl(path, resume_step)
        # line-buffered so the launcher and notebooks can tail it while the run goes on
        self.file = path.open("a" if resume_step is not None else "w", buffering=1)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()


class WandbMonitor(Monitor):
    def __init__(self, cfg: MonitorConfig, run_dir: Path, process: str, config: dict):
        import wandb

        mode: Any = cfg.wandb.mode  # validated by the config: auto, online or offline
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.run = wandb.init(
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            mode=mode,
            dir=str(run_dir),
            group=run_dir.name,
            job_type=process,
            name=f"{run_dir.name}-{process}",
            config=config,
            reinit="create_new",
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MultiMonitor(Monitor):
    def __init__(self, sinks: list[Monitor]):
        self.sinks = sinks

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_monitor(
    cfg: MonitorConfig, metrics_file: Path, process: str, config: dict | None = None, resume_step: int | None = None
) -> Monitor:
    sinks: list[Monitor] = [JsonlMonitor(metrics_file, resume_step)]
    if cfg.wandb.enabled:
        sinks.append(WandbMonitor(cfg, metrics_file.parent.parent, process, config or {}))
    return MultiMonitor(sinks)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line being written right now
                    pass
    return rows


def truncate_jsonl(path: Path, step: int) -> int:
    """Drop the rows of ``step`` and later (and a last line a crash cut short) from a metrics file,
    atomically; rewrites nothing when there is nothing to drop. Returns how many lines went."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not line.endswith("\n") or not isinstance(row, dict) or row.get("step", 0) >= step:
            continue
        kept.append(line)
    if len(kept) == len(lines):
        return 0
    from asyncrl.utils.atomic import write_text_atomic

    write_text_atomic(path, "".join(kept))
    return len(lines) - len(kept)


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
