"""CPU seconds per test, of the test worker's whole process tree: where the suite's time goes on a machine
whose cores it keeps busy (wall time per test there mostly says how busy the others were).

``python -m pytest --cpu-log cpu.jsonl [-n 4 --dist loadfile ...]`` (a plugin of tests/conftest.py) appends a
line a test, ``{"test", "cpu", "wall"}``. A test's CPU is what the worker and every live process under it
spent during the test, plus what the processes that ended and were waited for spent (Linux adds a waited
child's time to its parent's): processes a test orphans are not counted.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

TICKS = os.sysconf("SC_CLK_TCK")


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-log", help="append each test's CPU seconds (helpers.cpu_time) to this JSON-lines file"
    )


def tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and its descendants, with the children they waited for."""
    children: dict[int, list[int]] = {}
    spent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        spent[int(entry.name)] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += spent.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total / TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = item.config.getoption("--cpu-log")
    if not log:
        yield
        return
    cpu, wall = tree_cpu(os.getpid()), time.monotonic()
    yield
    cpu, wall = tree_cpu(os.getpid()) - cpu, time.monotonic() - wall
    line = {"test": item.nodeid, "cpu": round(cpu, 2), "wall": round(wall, 2)}
    with open(log, "a") as f:
        f.write(json.dumps(line) + "\n")
