"""The launcher's forked children (asyncrl/utils/forked.py): a child forked after the preload runs its module
as a fresh interpreter would (argv, its own environment, log, session, default signal handlers, none of the
launcher's exit or log handlers), its exit code comes back, ``stop`` ends it; and the launcher forks only
while it may."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from asyncrl.utils import forked

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "forked"

LAUNCHER = """
import atexit, json, logging, os, signal, subprocess, sys
from pathlib import Path
from asyncrl.utils import forked
from asyncrl.utils.children import spawn, stop

out = Path(sys.argv[1])
forked.PRELOAD = ("json",)  # the mechanics, not the libraries: a cheap preload
forked.preload()
atexit.register(lambda: open(out / "atexit", "a").write(f"{os.getpid()}\\n"))
signal.signal(signal.SIGTERM, lambda *a: None)
logging.basicConfig()
os.environ["FORKED_DROP"] = "the launcher's"
child = [sys.executable, "-m", "forked_child"]
done = spawn("done", [*child, "7"], out / "done.log", {"FORKED_X": "1", "FORKED_DROP": None}, fork=True)
sleeper = spawn("sleeper", [*child, "sleep"], out / "sleeper.log", fork=True)
try:
    sleeper.popen.wait(0.3)
    waited = "returned"
except subprocess.TimeoutExpired:
    waited = "timed out"
stop([sleeper], 10.0)
print(json.dumps({"kind": type(done.popen).__name__, "code": done.popen.wait(30), "waited": waited,
                  "sleeper": sleeper.popen.returncode, "launcher": os.getpid()}))
"""


def test_a_forked_child_runs_its_module_as_a_fresh_interpreter_would(tmp_path):
    env = {"PYTHONPATH": f"{FIXTURES}:{':'.join(sys.path)}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    parent = json.loads(proc.stdout)
    assert parent == {
        "kind": "ForkedChild",
        "code": 7,
        "waited": "timed out",
        "sleeper": -15,
        "launcher": parent["launcher"],
    }
    lines = (tmp_path / "done.log").read_text().splitlines()
    seen = json.loads(lines[0])
    assert seen == {
        "argv": ["7"], "main": "forked_child.py", "x": "1", "dropped": None, "sigterm_default": True,
        "sigint_default": True, "own_session": True, "log_handlers": 0,
    }  # fmt: skip
    assert lines[1:] == ["to stderr", "child atexit ran"], lines
    # the launcher's exit handler ran once, in the launcher: not in either child
    assert (tmp_path / "atexit").read_text() == f"{parent['launcher']}\n"


def test_the_launcher_forks_only_its_own_interpreters_modules_after_the_preload_and_without_threads(
    monkeypatch,
):
    argv = [sys.executable, "-m", "asyncrl", "train"]
    monkeypatch.setattr(forked, "_preloaded", False)
    assert not forked.can_fork(argv)
    monkeypatch.setattr(forked, "_preloaded", True)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    assert forked.can_fork(argv)
    assert not forked.can_fork(["/other/venv/bin/python", *argv[1:]]) and not forked.can_fork(
        [sys.executable, "x.py"]
    )
    # a progress display's thread: fresh interpreters
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    assert not forked.can_fork(argv)
