"""What each process imports at start-up: every end-to-end run starts all three, so a heavy import that a
process does not use costs every run (``python -X importtime -m asyncrl <command> ...`` shows the tree).

- the orchestrator never runs a model: no torch, transformers or peft;
- the sidecar and the trainer import peft only for ``model.lora`` (~0.6 s of CPU per start otherwise).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ENTRIES = {
    "orchestrator": (["asyncrl.orchestrator.orchestrate"], {"torch", "transformers", "peft", "vllm"}),
    "sidecar and trainer": (["asyncrl.inference.serve", "asyncrl.trainer.loop"], {"peft", "vllm"}),
}


def imported(modules: list[str], heavy: set[str]) -> list[str]:
    """Which of ``heavy`` importing ``modules`` in a fresh interpreter brings in."""
    code = f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
    code += f"print(json.dumps(sorted(set({sorted(heavy)!r}) & sys.modules.keys())))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_a_process_imports_no_heavy_module_it_does_not_use(entry):
    modules, heavy = ENTRIES[entry]
    assert imported(modules, heavy) == []


def test_the_check_sees_a_heavy_import():
    assert imported(["http.client"], {"email", "vllm"}) == ["email"]  # http.client parses headers with email
