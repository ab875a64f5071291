"""The crash checks' process tree (tests/helpers/processes.py): a grandchild orphaned by its parent's death
is still known and found alive; one that exits is not."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from helpers.processes import ProcessTree, tree_memory

# a parent that starts a sleeping grandchild in a session of its own, prints its PID, then waits to be killed
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_an_orphaned_grandchild_is_still_found_and_a_finished_one_is_not():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    tree = ProcessTree(parent.pid, interval_s=0.05).watch()
    try:
        deadline = time.monotonic() + 10
        while not any(p.pid == grandchild for p in tree.alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        time.sleep(0.2)
        # reparented away
        assert grandchild not in {p.pid for p in psutil.Process().children(recursive=True)}
        assert [p.pid for p in tree.alive()] == [grandchild]
        assert sum(tree_memory(grandchild).values()) > 0
    finally:
        tree.stop()
        psutil.Process(grandchild).kill()
    deadline = time.monotonic() + 10
    while tree.alive() and time.monotonic() < deadline:  # killed: gone, or a zombie until init reaps it
        time.sleep(0.05)
    assert tree.alive() == []
