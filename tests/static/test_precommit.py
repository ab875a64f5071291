"""The pre-commit hooks: a valid config whose every hook runs a tool that `make install` puts in the venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / ".pre-commit-config.yaml"


def test_config_is_valid_and_its_tools_are_installed():
    bin_dir = Path(sys.executable).parent
    check = subprocess.run(
        [bin_dir / "pre-commit", "validate-config", str(CONFIG)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    hooks = [h for repo in yaml.safe_load(CONFIG.read_text())["repos"] for h in repo["hooks"]]
    assert {h["id"] for h in hooks} == {"ruff-check", "ruff-format", "mypy"}
    for hook in hooks:
        tool = hook["entry"].split()[0]
        assert tool.startswith(".venv/bin/") and (bin_dir / Path(tool).name).exists(), hook
