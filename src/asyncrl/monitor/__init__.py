"""One monitor interface for all metrics: a line-buffered JSONL sink is always on, W&B is optional.

Keys are namespaced (``train/loss``, ``rollout/reward_mean``, ``async/staleness``). Tests and the
launcher's progress line read the JSONL files, never stdout.

W&B also gets the extras (``monitor.wandb.log_extras``, PRIME-RL's ``log-extras``) every ``interval`` steps:
a samples table and histograms, given as plain rows and value lists (:meth:`Monitor.log_extras`). Each
process's W&B run id is kept in ``<run_dir>/wandb/<process>.run_id``: a resumed run continues the same W&B
runs (``resume="allow"``) instead of starting new ones whose steps overlap the old ones. An offline W&B run
stays in ``<run_dir>/wandb/offline-run-*`` until ``wandb sync`` uploads it (:func:`wandb_offline_note` says
where and how, for the commands that own a run directory).
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

from asyncrl.config.run import MonitorConfig
from asyncrl.utils.atomic import write_text_atomic

log = logging.getLogger(__name__)


class Monitor(ABC):
    @abstractmethod
    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record ``metrics`` (namespaced keys) at ``step``."""

    def log_extras(  # noqa: B027 -- optional: only W&B shows tables and histograms
        self,
        step: int,
        samples: list[dict[str, Any]] | None = None,
        distributions: dict[str, list] | None = None,
    ) -> None:
        """A table of ``samples`` (one dict per row, same keys) and a histogram of each list in
        ``distributions``."""

    def close(self) -> None:  # noqa: B027 -- optional: a sink without resources has nothing to close
        pass


def extras_due(cfg: MonitorConfig, step: int) -> tuple[bool, bool]:
    """``(samples, distributions)``: which extras to compute at ``step`` (pure; both False without W&B, so
    nothing is computed for nothing)."""
    x = cfg.wandb.log_extras
    due = cfg.wandb.enabled and step % x.interval == 0
    return due and x.samples, due and x.distributions


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
    def __init__(
        self, cfg: MonitorConfig, run_dir: Path, process: str, config: dict, resume_step: int | None = None
    ):
        # wandb only with monitor.wandb.enabled: its import takes seconds
        # (`python -X importtime -c "import wandb"`)
        import wandb  # lazy: seconds to import; only with monitor.wandb.enabled

        mode: Any = wandb_mode(cfg)
        run_id, resumed = wandb_run_id(run_dir, process, resume_step)
        self.run = wandb.init(
            project=cfg.wandb.project,
            entity=cfg.wandb.entity,
            mode=mode,
            dir=str(run_dir),
            group=run_dir.name,
            job_type=process,
            name=f"{run_dir.name}-{process}",
            config=config,
            id=run_id,
            # W&B keeps the steps the interrupted run logged past the checkpoint and ignores them when logged
            # again (a resumed run replays them: the same values on CPU, bf16-close on GPUs)
            resume="allow" if resumed else None,
            reinit="create_new",
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_extras(
        self,
        step: int,
        samples: list[dict[str, Any]] | None = None,
        distributions: dict[str, list] | None = None,
    ) -> None:
        import wandb  # lazy: only with monitor.wandb.enabled (see __init__)

        data: dict[str, Any] = {}
        if samples:
            columns = list(samples[0])
            rows = [[row.get(c) for c in columns] for row in samples]
            data["samples"] = wandb.Table(columns=list[str | int](columns), data=rows)
        for name, values in (distributions or {}).items():
            if values:
                data[name] = wandb.Histogram([float(v) for v in values])
        if data:
            self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class MultiMonitor(Monitor):
    def __init__(self, sinks: list[Monitor]):
        self.sinks = sinks

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_extras(
        self,
        step: int,
        samples: list[dict[str, Any]] | None = None,
        distributions: dict[str, list] | None = None,
    ) -> None:
        for sink in self.sinks:
            sink.log_extras(step, samples, distributions)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def wandb_mode(cfg: MonitorConfig) -> str:
    """``online`` or ``offline``: ``auto`` is online when ``WANDB_API_KEY`` is set."""
    if cfg.wandb.mode == "auto":  # validated by the config: auto, online or offline
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return cfg.wandb.mode


def wandb_offline_note(cfg: MonitorConfig, run_dir: Path) -> str | None:
    """Where the offline W&B runs of ``run_dir`` are and the command that uploads them; ``None`` when W&B is
    off or online. Names the run directories once they exist, else the pattern W&B names them by."""
    if not cfg.wandb.enabled or wandb_mode(cfg) != "offline":
        return None
    found = sorted(str(p) for p in (run_dir / "wandb").glob("offline-run-*") if p.is_dir())
    where = " ".join(found) or str(run_dir / "wandb" / "offline-run-*")
    return f"W&B runs offline: its runs are in {where}; upload them with `wandb sync {where}`"


def wandb_run_id(run_dir: Path, process: str, resume_step: int | None) -> tuple[str, bool]:
    """The W&B run id of ``process`` in ``run_dir`` and whether it continues an earlier run: the id kept in
    ``wandb/<process>.run_id`` when resuming, else a new one (written there, atomically)."""
    path = run_dir / "wandb" / f"{process}.run_id"
    if resume_step is not None and path.is_file() and (kept := path.read_text().strip()):
        return kept, True
    from wandb.sdk.lib.runid import generate_id  # lazy: only with monitor.wandb.enabled (see WandbMonitor)

    run_id = generate_id()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, run_id + "\n")
    return run_id, False


def build_monitor(
    cfg: MonitorConfig,
    metrics_file: Path,
    process: str,
    config: dict | None = None,
    resume_step: int | None = None,
) -> Monitor:
    sinks: list[Monitor] = [JsonlMonitor(metrics_file, resume_step)]
    if cfg.wandb.enabled:
        sinks.append(WandbMonitor(cfg, metrics_file.parent.parent, process, config or {}, resume_step))
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
    write_text_atomic(path, "".join(kept))
    return len(lines) - len(kept)


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
