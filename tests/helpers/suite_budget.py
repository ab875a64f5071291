"""A pytest plugin for a suite spread over several calls to one machine (the lent GPU runs at most 10 minutes
a call, and the whole GPU suite takes longer): loaded by tests/conftest.py.

- ``--budget-s N``: a test that would start more than N seconds after the session began is skipped (reason
  ``time budget``), so the call ends before its limit and says what is left for the next call.
- ``--passed-file F``: tests whose ids F lists are skipped (``passed in an earlier call``), and each test
  that passes is appended to F. Calls with the same F and the same selection run the suite to its end.

    pytest -m gpu tests/gpu --budget-s 330 --passed-file outputs/gpu_suite/passed.txt
    # again, until no test is skipped for the budget (benchmarks/gpu_suite.sh does this on the lent GPU)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("asyncrl suite budget")
    group.addoption(
        "--budget-s", type=float, default=None, help="skip tests that would start after N seconds"
    )
    group.addoption(
        "--passed-file", default=None, help="skip tests listed here; append each test that passes"
    )


def pytest_configure(config):
    budget, passed = config.getoption("--budget-s"), config.getoption("--passed-file")
    if budget is not None or passed:
        config.pluginmanager.register(
            SuiteBudget(budget, Path(passed) if passed else None), "asyncrl-suite-budget"
        )


class SuiteBudget:
    """The options' state: when the session began, and the ids that passed in earlier calls."""

    def __init__(self, budget_s: float | None, passed_file: Path | None):
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.passed_file = passed_file
        self.done = (
            set(passed_file.read_text().splitlines()) if passed_file and passed_file.is_file() else set()
        )
        self.call_passed = False

    def pytest_runtest_setup(self, item):
        if item.nodeid in self.done:
            pytest.skip("passed in an earlier call (--passed-file)")
        if self.budget_s is not None and time.monotonic() - self.start > self.budget_s:
            pytest.skip(f"time budget: {self.budget_s:.0f} s spent before this test started (--budget-s)")

    def pytest_runtest_logreport(self, report):
        """A test counts as passed once its teardown passed too; an unexpected pass of an xfail test does
        not."""
        if self.passed_file is None:
            return
        if report.when == "call":
            self.call_passed = report.passed and not hasattr(report, "wasxfail")
        elif report.when == "teardown" and report.passed and self.call_passed:
            self.call_passed = False
            self.passed_file.parent.mkdir(parents=True, exist_ok=True)
            with self.passed_file.open("a") as f:  # at once: a call killed later keeps what passed before
                f.write(report.nodeid + "\n")
