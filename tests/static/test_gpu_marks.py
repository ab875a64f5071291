"""Every test that skips in CI runs somewhere. A GPU test says how many GPUs it needs by mark (`two_gpus`,
`four_gpus`), never by its own check of ``torch.cuda.device_count()``: the marks are what both
tests/conftest.py skips by and benchmarks/gpu_suite_lanes.sh deals lanes by, so a test that checks the count
itself lands in a one-GPU lane and skips there on every run of the suite. A CPU test that skips without vLLM
is imported into tests/gpu/test_vllm_unit.py, which the GPU scripts run where vLLM is."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).parents[1]
GPU_TESTS = TESTS / "gpu"
VLLM_NEEDED = re.compile(r"""find_spec\(["']vllm["']\)|importorskip\(["']vllm""")


def count_checks(text: str) -> list[int]:
    """The lines of ``text`` that read the number of GPUs."""
    return [i for i, line in enumerate(text.splitlines(), 1) if re.search(r"\bdevice_count\s*\(", line)]


def test_gpu_tests_need_gpus_by_mark_only():
    found = {
        f"{path.name}:{line}": path.read_text().splitlines()[line - 1].strip()
        for path in sorted(GPU_TESTS.glob("*.py"))
        for line in count_checks(path.read_text())
    }
    assert not found, f"mark these tests two_gpus or four_gpus instead of checking the count: {found}"


def test_the_check_sees_a_count_check():
    skip = '@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")\ndef test_x(): ...'
    assert count_checks(skip) == [1] and count_checks("@pytest.mark.two_gpus\ndef test_x(): ...") == []


def needing_vllm(text: str) -> set[str]:
    """The test functions of a module's ``text`` that skip without vLLM (their decorators or body ask)."""
    return {
        node.name
        for node in ast.parse(text).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test_")
        and VLLM_NEEDED.search(ast.unparse(node))  # decorators included
    }


def imported_names(text: str) -> set[str]:
    """What a module imports from others, as ``module.name``."""
    return {
        f"{node.module}.{alias.name}"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_tests_that_need_vllm_run_on_the_gpu_machine():
    imported = imported_names((GPU_TESTS / "test_vllm_unit.py").read_text())
    wanted = {
        f"{folder}.{path.stem}.{name}"
        for folder in ("unit", "integration")
        for path in sorted((TESTS / folder).glob("test_*.py"))
        for name in needing_vllm(path.read_text())
    }
    missing = sorted(wanted - imported)
    assert wanted and not missing, f"import these into tests/gpu/test_vllm_unit.py: {missing}"


def test_the_vllm_check_sees_a_skip():
    skip = 'import pytest\n@pytest.mark.skipif(find_spec("vllm") is None, reason="")\ndef test_a(): ...\n'
    body = 'def test_b():\n    pytest.importorskip("vllm")\n\ndef test_c(): ...\n'
    assert needing_vllm(skip) == {"test_a"} and needing_vllm(body) == {"test_b"}


def test_gpu_marks_that_the_scripts_cannot_honour_are_refused():
    from conftest import gpus_needed

    fine = ({"slow"}, {"gpu"}, {"gpu", "two_gpus"}, {"gpu", "trainer_env"})
    assert [gpus_needed(marks) for marks in fine] == [0, 1, 2, 1]
    for wrong in ({"two_gpus"}, {"trainer_env"}, {"gpu", "four_gpus", "trainer_env"}):
        with pytest.raises(ValueError):
            gpus_needed(wrong)
