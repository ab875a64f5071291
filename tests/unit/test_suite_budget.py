"""tests/helpers/suite_budget.py: a suite spread over several calls runs each test once, and a spent budget
skips the rest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SAMPLE = """
import time
import pytest
@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown")
def test_a():
    time.sleep(4)
def test_b():
    pass
def test_c():
    assert False
def test_d(broken_teardown):
    pass
@pytest.mark.xfail(reason="expected to fail")
def test_e():
    pass
"""


def run_pytest(where: Path, *args: str) -> str:
    # the plugin under test alone: loading every installed one (hypothesis, schemathesis...) costs 1.8 s
    # a start (`time python -m pytest -q` of a one-test file with and without PYTEST_DISABLE_PLUGIN_AUTOLOAD)
    env = {
        **os.environ,
        "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "helpers.suite_budget",
            "-p",
            "no:cacheprovider",
            "-rs",
            "-q",
            *args,
        ],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.stdout


def test_passed_file_skips_what_passed_and_keeps_failures(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    passed = tmp_path / "passed.txt"
    first = run_pytest(tmp_path, "test_sample.py", "--passed-file", str(passed))
    assert "1 failed, 3 passed, 1 xpassed, 1 error" in first
    # test_d's teardown failed and test_e passed unexpectedly: neither counts as passed
    assert passed.read_text().splitlines() == ["test_sample.py::test_a", "test_sample.py::test_b"]
    second = run_pytest(tmp_path, "test_sample.py", "--passed-file", str(passed))
    assert (
        "1 failed, 1 passed, 2 skipped, 1 xpassed, 1 error" in second
        and "passed in an earlier call" in second
    )


def test_budget_skips_tests_that_would_start_after_it(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = run_pytest(tmp_path, "test_sample.py", "--budget-s", "3")
    # test_a starts at once and sleeps past the budget: the four after it are skipped, not run
    assert "1 passed, 4 skipped" in out and "time budget" in out
    assert "failed" not in out
