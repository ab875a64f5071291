"""The suite's CPU-per-test measurement (tests/helpers/cpu_time.py) counts what a test's waited-for processes
spent."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.cpu_time import tree_cpu


def test_a_waited_grandchilds_cpu_is_counted_and_an_idle_ones_is_not():
    before = tree_cpu(os.getpid())
    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\n"
    # a child that runs the burner as its own child: the grandchild's time reaches the worker through two
    # waits
    subprocess.run(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"],
        check=True,
    )
    burned = tree_cpu(os.getpid()) - before
    assert 1.0 <= burned < 3.0, burned
    before = tree_cpu(os.getpid())
    subprocess.run(["sleep", "1"], check=True)
    assert tree_cpu(os.getpid()) - before < 0.3
