"""A GPU test says how many GPUs it needs by mark (`two_gpus`, `four_gpus`), never by its own check of
``torch.cuda.device_count()``: the marks are what both tests/conftest.py skips by and
benchmarks/gpu_suite_lanes.sh deals lanes by, so a test that checks the count itself lands in a one-GPU lane
and skips there on every run of the suite."""

from __future__ import annotations

import re
from pathlib import Path

GPU_TESTS = Path(__file__).parents[1] / "gpu"


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
