"""Run metadata: enough to reproduce a run directory (git sha, dirty flag, versions, devices, argv)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from asyncrl import numerics
from asyncrl.config.compose import to_yaml
from asyncrl.utils.atomic import write_json_atomic, write_text_atomic

PACKAGES = (
    "asyncrl",
    "torch",
    "transformers",
    "lightning-fabric",
    "hydra-core",
    "omegaconf",
    "safetensors",
    "fastapi",
    "uvicorn",
    "openai",
    "httpx",
    "wandb",
    "numpy",
    "vllm",
    "flash-attn",
)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).resolve().parent
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def devices() -> dict:
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "machine": platform.machine()}
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        info["gpus"] = [line for line in out.stdout.splitlines() if line.strip()]
    return info


def run_meta(argv: list[str] | None = None) -> dict:
    status = _git("status", "--porcelain")
    return {
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "python": sys.version.split()[0],
        "versions": versions(),
        "devices": devices(),
        "argv": list(argv if argv is not None else sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_run_files(run, cfg, overrides: list[str] | None, **extra) -> None:
    """Resolved config, overrides and run metadata (plus ``extra`` fields), written before step 0.
    ``run`` is an :class:`asyncrl.paths.RunDir`, ``cfg`` the :class:`asyncrl.config.Config`. The metadata
    records the numerics mode, the CPU and every variable the mode sets (:func:`asyncrl.numerics.describe`)."""
    write_text_atomic(run.config_file, to_yaml(cfg))
    write_text_atomic(run.overrides_file, yaml.safe_dump(list(overrides or [])))
    meta = {**run_meta(), "numerics": numerics.describe(cfg.numerics, numerics.run_threads(cfg)), **extra}
    write_json_atomic(run.meta_file, meta)
