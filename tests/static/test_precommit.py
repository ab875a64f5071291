"""The pre-commit hooks: a valid config whose every hook runs a tool that `make install` puts in the venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / ".pre-commit-config.yaml"


def lint_commands() -> list[str]:
    """The commands of the Makefile's ``lint`` recipe, without the venv's ``$(BIN)/``."""
    recipe = (ROOT / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    lines = recipe.splitlines()[1:]
    return [line.strip().removeprefix("$(BIN)/") for line in lines if line.startswith("\t")]


def tool_of(command: str) -> tuple[str, ...]:
    """What a command runs: a script or subcommand with its program (``python x.py``, ``ruff check``),
    else the program."""
    words = command.split()
    return tuple(words[:2]) if words[0] in ("python", "ruff") else (words[0],)


def test_config_is_valid_and_its_tools_are_installed():
    """Valid, and its hooks run what ``make lint`` runs (docs/testing.md says so), each from the venv."""
    bin_dir = Path(sys.executable).parent
    check = subprocess.run(
        [bin_dir / "pre-commit", "validate-config", str(CONFIG)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    hooks = [h for repo in yaml.safe_load(CONFIG.read_text())["repos"] for h in repo["hooks"]]
    assert {tool_of(h["entry"].removeprefix(".venv/bin/")) for h in hooks} == {
        tool_of(line) for line in lint_commands()
    }
    for hook in hooks:
        tool = hook["entry"].split()[0]
        assert tool.startswith(".venv/bin/") and (bin_dir / Path(tool).name).exists(), hook
