"""Config of what watches a run: metrics sinks (JSONL, W&B) and the launcher.

Torch-free: the CLI imports it to print ``--help``.

Each field is typed, documented in its ``F(doc=...)`` and bounded where it can be; YAML files in ``conf/``
only choose and override values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from asyncrl.config.fields import F


@dataclass
class LogExtrasConfig:
    interval: int = F(10, "log the extras at steps 0, interval, 2 * interval, ...", ge=1)
    samples: bool = F(
        True,
        "orchestrator: a table of rollouts (prompt, completion, reward, "
        "advantage, policy version, environment)",
    )
    max_samples: int = F(
        16, "rows of the samples table per logged step (spread over the step's groups)", ge=1
    )
    distributions: bool = F(
        True,
        "histograms: reward, advantage, completion length, staleness (orchestrator); entropy and importance "
        "ratio of the loss tokens (trainer)",
    )


@dataclass
class WandbConfig:
    enabled: bool = F(False, "log to Weights & Biases as well as JSONL")
    project: str = F("asyncrl", "W&B project")
    entity: Optional[str] = F(None, "W&B entity")
    mode: str = F(
        "auto", "'auto' = online with WANDB_API_KEY, offline without", choices=("auto", "online", "offline")
    )
    log_extras: LogExtrasConfig = F(LogExtrasConfig(), "W&B tables and histograms besides the scalars")


@dataclass
class MonitorConfig:
    wandb: WandbConfig = F(WandbConfig(), "Weights & Biases")


@dataclass
class LauncherConfig:
    progress: bool = F(True, "show a live progress line")
    trainer_python: str = F(
        "",
        "the Python interpreter the trainer runs in ('': the launcher's own): another environment's, e.g. a "
        "trainer environment with flash-attn-4, whose pins vLLM's exclude (docs/gpus.md); checked before a "
        "launch for what the config asks of the trainer",
    )
    inference_python: str = F(
        "",
        "the Python interpreter the sidecars run in ('': the launcher's own), e.g. the environment with "
        "vLLM; checked before a launch for what the config asks of them",
    )
    preload: bool = F(
        True,
        "start the CPU processes (the built-in sidecar, a CPU trainer, the orchestrator) as forks of "
        "the launcher after it imports torch and transformers once, instead of a fresh interpreter "
        "each: each would spend seconds of CPU importing them (asyncrl/utils/forked.py); `asyncrl "
        "eval` starts its built-in sidecar so too; vLLM and CUDA processes always start fresh",
    )
    overwrite: bool = F(False, "replace a finished or failed run already in run_dir (default: refuse)")
    shutdown_timeout_s: float = F(10.0, "grace period before stopped processes are killed", gt=0)
    poll_s: float = F(0.2, "how often the launcher checks its processes", gt=0)
    max_restarts: int = F(
        3,
        "times `asyncrl rl` restarts a sidecar that died (on its port; the orchestrator waits for it and "
        "brings it to the current policy); 0 = a dead sidecar stops the run",
        ge=0,
    )
