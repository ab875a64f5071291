"""The code sandbox: right verdicts, every attack contained and scored 0, and no process left behind.

Each attack is a program that would *pass* its test if the attack worked (it returns or prints what it stole
or did), so a contained attack is a failed test; the host side checks the damage directly too (the planted
file still unread, no connection on the host's server, no file written, no process of the attack alive).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

from asyncrl.sandbox import Limits, Sandbox, SandboxUnavailable, TestCase
from helpers.fakes import unusable_bwrap

# shrunk so the timeouts of the attack tests cost seconds, not tens of seconds
LIMITS = Limits(
    timeout_s=6.0, test_timeout_s=1.5, cpu_s=1, memory_mb=256, nproc=12, file_size_kb=256, tmpfs_mb=8
)


@pytest.fixture(scope="module")
def sandbox():
    # the session's own servers (a sidecar fixture started earlier in this process) are not the pool's
    before = set(psutil.Process().children(recursive=True))
    with Sandbox(LIMITS, workers=2) as sb:
        yield sb
    left = set(psutil.Process().children(recursive=True)) - before
    assert not left, f"the closed pool left processes behind: {left}"


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def alive_with(marker: str) -> list[int]:
    """PIDs of every process on the machine whose command line holds ``marker``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def run_one(sb: Sandbox, code: str, expected, fn: str = "f", args=()):
    """Run ``code``'s ``fn(*args)`` expecting ``expected``, then check by PID that nothing of the sandbox
    that ran it is left: not bwrap, not the namespace's init, no process in its PID namespace. The namespace
    is held open from the take to the check: a freed namespace's inode number goes to the next one the kernel
    makes (the pool warms the next sandbox during the run), and a process of that one would read as a
    survivor."""
    taken: list = []
    take = sb._take

    def take_and_note():
        worker = take()
        held = os.open(f"/proc/{worker.init_pid}/ns/pid", os.O_RDONLY)
        taken.append((worker, pid_namespace(worker.init_pid), held))
        return worker

    sb._take = take_and_note  # type: ignore[method-assign]
    try:
        result = sb.run(code, [TestCase("call", expected, fn=fn, args=list(args))])
    finally:
        del sb._take
    ((worker, ns, held),) = taken
    try:
        assert ns is not None and ns == f"pid:[{os.fstat(held).st_ino}]"
        assert not psutil.pid_exists(worker.proc.pid), f"bwrap {worker.proc.pid} outlived its run"
        assert not psutil.pid_exists(worker.init_pid), (
            f"the sandbox's init {worker.init_pid} outlived its run"
        )
        left = [p for p in psutil.pids() if pid_namespace(p) == ns]
        assert not left, f"processes of the sandbox's PID namespace outlived its run: {left}"
    finally:
        os.close(held)
    return result


# -- verdicts -------------------------------------------------------------------------------------------


def test_call_and_io_tests_get_the_right_verdicts(sandbox):
    code = "def add(a, b):\n    print('adding', a, b)\n    return a + b\n"
    tests = [
        TestCase("call", 3, fn="add", args=[1, 2]),
        TestCase("call", 4, fn="add", args=[1, 2]),  # wrong expected value: fails
        TestCase("call", [1, 2], fn="add", args=[[1], [2]]),
        TestCase("call", 0.3, fn="add", args=[0.1, 0.2]),  # floats to a relative 1e-9
        TestCase("call", 1, fn="missing"),
    ]
    r = sandbox.run(code, tests)
    assert [t.passed for t in r.tests] == [True, False, True, True, False]
    assert r.tests[0].stdout == "adding 1 2\n" and r.tests[0].status == "ok"
    assert "no function 'missing'" in r.tests[4].error
    assert r.fraction_passed == pytest.approx(3 / 5)

    script = "import sys\nn = int(sys.stdin.read())\nprint(n * 2)  \nprint('done')\n"
    r = sandbox.run(script, [TestCase("io", "8\ndone", stdin="4"), TestCase("io", "9\ndone\n", stdin="4")])
    assert [t.passed for t in r.tests] == [True, False]


def test_a_test_that_raises_or_is_slow_fails_alone(sandbox):
    code = (
        "import time\ndef f(x):\n    if x == 1: raise ValueError('no')\n    if x == 2: "
        "time.sleep(60)\n    return x\n"
    )
    tests = [TestCase("call", x, fn="f", args=[x]) for x in (0, 1, 2, 3)]
    r = sandbox.run(code, tests)
    assert [t.passed for t in r.tests] == [True, False, False, True]
    assert r.tests[1].error == "ValueError: no" and r.tests[2].status == "timeout"


def test_the_expected_values_never_enter_the_sandbox(sandbox):
    # the program sees only the inputs: it prints every global and local it can reach
    code = (
        "import gc, sys\ndef f(x):\n    seen = repr([o for o in gc.get_objects() if isinstance(o, (dict, "
        "list, str))]) + sys.stdin.read()\n    print(''.join(['SECRET', '-EXPECTED']) in seen)  # made "
        "after the search: not a constant to find\n    return x\n"
    )
    r = sandbox.run(code, [TestCase("call", "SECRET-EXPECTED", fn="f", args=["input"])])
    assert not r.tests[0].passed and r.tests[0].stdout == "False\n"


# -- attacks --------------------------------------------------------------------------------------------


def test_fork_bomb(sandbox):
    r = run_one(sandbox, "import os\ndef f():\n    while True:\n        os.fork()\n", "survived")
    assert not r.tests[0].passed


def test_memory_bomb(sandbox):
    r = run_one(
        sandbox, "def f():\n    blocks = []\n    while True:\n        blocks.append(bytearray(1 << 26))\n", 1
    )
    assert not r.tests[0].passed and "MemoryError" in r.tests[0].error


def test_infinite_loop_and_the_whole_program_deadline(sandbox):
    r = run_one(sandbox, "def f():\n    while True:\n        pass\n", 1)
    assert not r.tests[0].passed and r.tests[0].status in ("timeout", "error")
    # a program whose top level never ends, for every test: the whole run stops at timeout_s
    start = time.monotonic()
    r = sandbox.run("import time\ntime.sleep(3600)\n", [TestCase("call", 1, fn="f")] * 10)
    assert r.fraction_passed == 0 and time.monotonic() - start < LIMITS.timeout_s + 2


def test_busy_children_left_behind_are_killed_with_the_sandbox(sandbox):
    marker = f"asyncrl-leftover-{uuid.uuid4().hex}"
    code = (
        "import subprocess, sys\n"
        "def f():\n"
        "    for _ in range(3):\n"
        "        subprocess.Popen([sys.executable, '-c', 'while True: pass  # "
        f"{marker}'], start_new_session=True)\n"
        "    return 'spawned'\n"
    )
    r = run_one(sandbox, code, "spawned")
    assert r.tests[0].passed  # the program did what it says...
    # ...and none of it survives
    assert not alive_with(marker), "a child of the program outlived the sandbox"


def test_no_network(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    listener = threading.Thread(target=accept)
    listener.start()
    code = (
        "import socket\n"
        "def f(port):\n"
        "    out = []\n"
        "    for addr in [('127.0.0.1', port), ('1.1.1.1', 80), ('8.8.8.8', 53)]:\n"
        "        s = socket.socket()\n"
        "        s.settimeout(1)\n"
        "        try:\n"
        "            s.connect(addr)\n"
        "            out.append('connected')\n"
        "        except OSError as e:\n"
        "            print(addr, e)\n"
        "    try:\n"
        "        socket.getaddrinfo('pypi.org', 443)\n"
        "        out.append('resolved')\n"
        "    except OSError as e:\n"
        "        print('dns', e)\n"
        "    return out\n"
    )
    try:
        r = run_one(sandbox, code, ["connected", "connected", "connected", "resolved"], args=[port])
    finally:
        listener.join()
        server.close()
    assert not r.tests[0].passed and not accepted
    assert "Connection refused" in r.tests[0].stdout and "unreachable" in r.tests[0].stdout


def test_no_writes_outside_the_private_tmp(sandbox, tmp_path):
    target = tmp_path / "planted-by-sandbox"
    code = (
        "import os\n"
        "def f(paths):\n"
        "    wrote = []\n"
        "    for p in paths:\n"
        "        try:\n"
        "            with open(p, 'w') as fh:\n"
        "                fh.write('x')\n"
        "            wrote.append(p)\n"
        "        except OSError as e:\n"
        "            print(p, e.strerror)\n"
        "    return wrote\n"
    )
    paths = [str(target), "/usr/planted", "/planted", "/dev/planted", os.path.join(os.getcwd(), "planted")]
    r = run_one(sandbox, code, paths, args=[paths])
    assert not r.tests[0].passed
    assert not target.exists() and not os.path.exists(os.path.join(os.getcwd(), "planted"))
    # the private /tmp is writable but bounded (tmpfs_mb), and gone with the sandbox
    r = run_one(sandbox, "def f():\n    open('/tmp/x', 'w').write('a' * (64 << 20))\n    return 1\n", 1)
    assert not r.tests[0].passed


def test_host_files_and_environment_are_unreadable(sandbox, tmp_path, monkeypatch):
    secret = f"planted-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("ASYNCRL_PLANTED_SECRET", secret)
    planted = tmp_path / "secret.txt"
    planted.write_text(secret)
    code = (
        "import glob, os\n"
        "def f(paths):\n"
        "    found = [os.environ.get('ASYNCRL_PLANTED_SECRET', '')]\n"
        "    for p in paths + glob.glob('/proc/*/environ'):\n"
        "        try:\n"
        "            found.append(open(p, errors='replace').read())\n"
        "        except OSError as e:\n"
        "            print(p, e.strerror)\n"
        "    blob = ' '.join(found)\n"
        f"    return '{secret[:14]}' in blob and blob[blob.index('{secret[:14]}'):][:{len(secret)}]\n"
    )
    paths = [str(planted), f"/proc/{os.getpid()}/environ", "/etc/shadow", "/etc/passwd", "/root/.bashrc"]
    r = run_one(sandbox, code, secret, args=[paths])
    assert not r.tests[0].passed and secret not in r.tests[0].stdout + r.tests[0].stderr


def test_killing_the_parent_and_everything_in_reach(sandbox):
    host = os.getpid()
    for attack in (
        "os.kill(os.getppid(), signal.SIGKILL)",
        "os.kill(1, signal.SIGKILL)",
        "os.kill(-1, signal.SIGKILL)",
        f"os.kill({host}, signal.SIGKILL)",  # our PID: not in the sandbox's PID namespace
    ):
        code = (
            f"import os, signal\ndef f():\n    try:\n        {attack}\n    except "
            "OSError:\n        pass\n    return 1"
        )
        r = run_one(sandbox, code, 2)
        assert not r.tests[0].passed
    assert psutil.pid_exists(host)
    # the pool works on
    assert sandbox.run("def f():\n    return 1\n", [TestCase("call", 1, fn="f")]).tests[0].passed


def test_gigabytes_of_output(sandbox):
    for code in (
        "def f():\n    while True:\n        print('x' * 65536)\n",
        "import sys\ndef f():\n    while True:\n        sys.stderr.write('y' * 65536)\n",
        "def f():\n    return 'z' * (1 << 30)\n",  # the return value
    ):
        r = run_one(sandbox, code, "done")
        t = r.tests[0]
        assert not t.passed and len(t.stdout) <= LIMITS.output_chars and len(t.stderr) <= LIMITS.output_chars


def test_ctypes_tricks(sandbox):
    for attack, expected in (
        ("ctypes.string_at(0)", "read"),  # segfault
        ("libc.setuid(0) == 0 and os.getuid() == 0 and 'root'", "root"),
        # a nested user namespace: --disable-userns
        ("libc.unshare(0x10000000) == 0 and 'userns'", "userns"),
        ("libc.mount(b'none', b'/mnt', b'tmpfs', 0, None) == 0 and 'mounted'", "mounted"),
        ("libc.chroot(b'/tmp') == 0 and 'chrooted'", "chrooted"),
        (f"libc.ptrace(16, {os.getpid()}, 0, 0) == 0 and 'attached'", "attached"),  # PTRACE_ATTACH to us
    ):
        code = (
            f"import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\ndef f():\n    return {attack}\n"
        )
        r = run_one(sandbox, code, expected)
        assert not r.tests[0].passed, attack


def test_the_run_goes_on_after_every_attack(sandbox):
    r = sandbox.run(
        "def f(x):\n    return x * 2\n", [TestCase("call", 2 * k, fn="f", args=[k]) for k in range(10)]
    )
    assert r.fraction_passed == 1.0


# -- no isolation, no run -------------------------------------------------------------------------------


def test_refuses_to_run_without_isolation(tmp_path):
    with (
        unusable_bwrap() as fake,
        pytest.raises(SandboxUnavailable, match="No permissions to create new namespace"),
    ):
        Sandbox(LIMITS, workers=1, bwrap=fake)
    with pytest.raises(SandboxUnavailable, match="not an executable"):
        Sandbox(LIMITS, workers=1, bwrap=str(tmp_path / "absent"))


def test_a_killed_pool_takes_its_sandboxes_with_it(tmp_path):
    """kill -9 of the process that owns the pool (the orchestrator): its warm sandboxes and a running one
    go."""
    script = (
        "import json, sys, threading\n"
        "from asyncrl.sandbox import Limits, Sandbox, TestCase\n"
        "sb = Sandbox(Limits(test_timeout_s=60, timeout_s=60, cpu_s=60), workers=2)\n"
        "threading.Thread(target=sb.run, args=('import time\\ndef f():\\n    time.sleep(60)', "
        "[TestCase('call', 1, fn='f')]), daemon=True).start()\n"
        "import time; time.sleep(0.5)\n"
        "print(json.dumps([p for w in sb._live for p in (w.proc.pid, w.init_pid)]), flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = psutil.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = json.loads(owner.stdout.readline())
    assert len(pids) >= 4 and all(psutil.pid_exists(p) for p in pids)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.05)
    assert not [
        p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]
