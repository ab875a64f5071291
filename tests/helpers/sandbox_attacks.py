"""Programs that go for the sandbox's runner, each with the tests it is scored on, and a runner of them all.

Each program's honest answer scores exactly ``EARNS``: a program passes a test it should fail only if its
attack reached the runner (read or wrote its memory or descriptors, got a forged result line read first), and
a sandbox that ends without a result (a killed or stalled runner) shows as ``crashed`` or ``timeout``.
Standard library and ``asyncrl.sandbox`` only: tests/integration/test_sandbox_forgery.py runs this file as
``nobody`` too, from a copy that user can read (``python sandbox_attacks.py`` prints one JSON line per
attack).
"""

from __future__ import annotations

import json
import sys

from asyncrl.sandbox import Limits, Sandbox, TestCase

# f() returns 1 only when the attack got through; 0 is its honest answer
RUNNER_MEMORY = """
def f():
    for mode in ("r+b", "rb"):
        try:
            with open("/proc/1/mem", mode) as mem:
                return 1
        except OSError:
            pass
    return 0
"""

RUNNER_DESCRIPTORS = """
import os
def f():
    reached = 0
    for fd in ("0", "1", "2", "3", "4", "5"):
        for mode in (os.O_RDONLY, os.O_WRONLY):
            try:
                os.close(os.open("/proc/1/fd/" + fd, mode | os.O_NONBLOCK))
                reached = 1
            except OSError:
                pass
    try:
        os.listdir("/proc/1/fd")
        reached = 1
    except OSError:
        pass
    return reached
"""

# a result line that would score the test as passed, written everywhere the pool might read it from
FORGED_LINES = """
import json, os
def f():
    result = {"status": "ok", "value": 1, "time_s": 0.0, "stdout": "", "stderr": ""}
    line = json.dumps({"tests": [result]}) + "\\n"
    for path in ("/proc/1/fd/1", "/proc/1/fd/2", "/proc/self/fd/1", "/proc/self/fd/2",
                 "/dev/stdout", "/dev/stderr"):
        try:
            with open(path, "w") as out:
                out.write(line * 64)
        except OSError:
            pass
    print(line, end="")
    os.write(3, b'{"value": 1}')  # the value channel too: this and the real return make no JSON
    return 0
"""

SIGNALS = """
import os, signal
def f():
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGSTOP, signal.SIGKILL)
    for sig in sigs:
        for target in (1, 0, -1):
            try:
                os.kill(target, sig) if target != 0 else None
            except OSError:
                pass
    try:
        os.killpg(1, signal.SIGKILL)
    except OSError:
        pass
    return 0
"""

# the first test leaves processes and descriptors that fill the sandbox; the second must still run and pass
EXHAUSTION = """
import os, time
def f(k):
    if k == 1:
        return 1
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for _ in range(64):
        try:
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
        except OSError:
            break
    return -1
"""

# the first test plants traps where the runner once kept the next test's output; the second must pass
RESULT_FILE_RACE = """
import os, time
def f(k):
    if k == 1:
        print("x" * 100)
        return 1
    for name in ("out", "err", "in"):
        for j in range(1, 4):
            path = "/tmp/%s_%d" % (name, j)
            try:
                os.mkfifo(path)
            except OSError:
                pass
    try:
        os.symlink("/dev/zero", "/tmp/out_9")
    except OSError:
        pass
    if os.fork() == 0:  # and a process that keeps swapping them
        while True:
            for j in range(1, 4):
                try:
                    os.unlink("/tmp/out_%d" % j)
                    os.symlink("/dev/zero", "/tmp/out_%d" % j)
                except OSError:
                    pass
            time.sleep(0.001)
    return -1
"""

CALL = [TestCase("call", 1, fn="f")]
TWO = [TestCase("call", 0, fn="f", args=[0]), TestCase("call", 1, fn="f", args=[1])]
# name: (program, tests, the fraction its honest behaviour earns)
ATTACKS = {
    "runner_memory": (RUNNER_MEMORY, CALL, 0.0),
    "runner_descriptors": (RUNNER_DESCRIPTORS, CALL, 0.0),
    "forged_result_lines": (FORGED_LINES, CALL, 0.0),
    "signal_the_runner": (SIGNALS, CALL, 0.0),
    "exhaust_processes_and_descriptors": (EXHAUSTION, TWO, 0.5),
    "race_the_result_files": (RESULT_FILE_RACE, TWO, 0.5),
}
LIMITS = Limits(
    timeout_s=8.0, test_timeout_s=2.0, cpu_s=1, memory_mb=256, nproc=12, file_size_kb=256, tmpfs_mb=8
)


def run_all() -> dict[str, dict]:
    """Every attack's status, fraction passed and first error, from one pool."""
    out = {}
    with Sandbox(LIMITS, workers=1) as sandbox:
        for name, (code, tests, _) in ATTACKS.items():
            result = sandbox.run(code, tests)
            errors = [t.error for t in result.tests if t.error]
            out[name] = {"status": result.status, "fraction": result.fraction_passed, "errors": errors[:2]}
    return out


if __name__ == "__main__":
    for name, result in run_all().items():
        print(json.dumps({"attack": name, **result}))
    sys.stdout.flush()
