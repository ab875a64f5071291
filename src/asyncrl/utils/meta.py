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
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
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
        "argv": redacted(list(argv if argv is not None else sys.argv)),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# settings whose values are secrets: kept out of what is written for people to read (argv, overrides)
SECRETS = ("inference.admin_token",)


def redacted(args: list[str]) -> list[str]:
    """``args`` (command-line words, Hydra overrides) with the value of every :data:`SECRETS` override
    hidden."""
    return [
        f"{a.split('=', 1)[0]}=<redacted>" if a.lstrip("+~").split("=", 1)[0] in SECRETS else a for a in args
    ]


def write_run_files(run, cfg, overrides: list[str] | None, **extra) -> None:
    """Resolved config, overrides and run metadata (plus ``extra`` fields), written before step 0.
    ``run`` is an :class:`asyncrl.paths.RunDir`, ``cfg`` the :class:`asyncrl.config.Config`. The metadata
    records the numerics mode, the CPU and every variable the mode sets (:func:`asyncrl.numerics.describe`).

    The resolved config is what the run's processes start from, so it holds ``inference.admin_token`` when
    one is set: ``configs/`` is then made readable by its owner only (0700) before anything is written in it;
    the overrides and the argv in ``run_meta.json`` show ``<redacted>`` instead."""
    if cfg.inference.admin_token:
        run.configs.mkdir(parents=True, exist_ok=True)
        run.configs.chmod(0o700)
    write_text_atomic(run.config_file, to_yaml(cfg))
    write_text_atomic(run.overrides_file, yaml.safe_dump(redacted(list(overrides or []))))
    meta = {**run_meta(), "numerics": numerics.describe(cfg.numerics, numerics.run_threads(cfg)), **extra}
    write_json_atomic(run.meta_file, meta)
