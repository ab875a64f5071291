"""The program that runs *inside* the sandbox (standard library only; never imported by asyncrl itself).

``asyncrl.sandbox.pool`` starts it under bubblewrap (and its seccomp filter) as
``python -I -S -B -c <this source>`` before any job exists (a pre-warmed worker): it prints ``ready``, then
reads one job as a JSON line on stdin (``memory_mb`` is the address space the pool gives each process, see
``asyncrl.sandbox.bounds``)::

    {"code": "...", "tests": [{"kind": "call", "fn": "f", "args": [...], "kwargs": {}},
                              {"kind": "io", "stdin": "..."}],
     "limits": {"cpu_s": 2, "memory_mb": 512, "nproc": 16, "file_size_kb": 1024, "nofile": 64,
                "test_timeout_s": 2.0, "value_bytes": 1048576}}

and answers one JSON line ``{"tests": [...]}``, one entry per test, then exits (one job per sandbox: every
program gets a fresh namespace). It is the PID namespace's init: nothing in the sandbox can kill it, and its
exit kills whatever the program left running. Each test runs in its own forked child under the rlimits, with
stdout and stderr going to two memory files the runner opened (the file-size limit bounds each; closed after
the test). A ``call`` test sends back the function's return value, an ``io`` test its stdout; the expected
values never enter the sandbox, so nothing running in here can forge a pass (the verdict is taken outside, in
``asyncrl.sandbox``).

The program runs as the runner's own user, so the runner keeps itself out of its reach: it makes itself
non-dumpable before it says ``ready`` (``PR_SET_DUMPABLE``: its ``/proc/1/mem``, ``/proc/1/fd/*`` and
``/proc/1/ environ`` are then closed to a process without ``CAP_SYS_PTRACE``, which nothing in here has),
ignores the one signal Python would act on (``SIGINT``; as the namespace's init it receives no other signal
from inside), reads each test's stdout and stderr from memory files it opened itself (``memfd_create``: no
path in ``/tmp`` the program could swap for a FIFO or ``/dev/zero``), with a bound, and kills whatever a test
left running before the next test starts (``kill(-1)`` from init reaches every other process of the
namespace). A refusal of either start-up step is printed instead of ``ready``: the pool then refuses to start
rather than run programs beside a reachable runner.
"""

import _signal  # the C module: `signal`'s enums would add milliseconds to the start (see SIGKILL below)
import ctypes  # ~4 ms of the start (prctl), paid before any job: the sandbox is pre-warmed
import json
import os
import resource
import select
import sys
import time

# Linux's numbers, spelled out: importing `signal` (and its enum) would add milliseconds to every sandbox's
# start (`python -I -S -X importtime -c 'import signal'` shows them)
SIGKILL = 9
SIGNALS = {
    SIGKILL: "SIGKILL",
    11: "SIGSEGV, a crash",
    24: "SIGXCPU, the CPU time limit",
    25: "SIGXFSZ, the output limit",
    31: "SIGSYS, a system call the sandbox denies",
}
SIGSYS = 31  # what the seccomp filter kills a process with (asyncrl.sandbox.bounds)
SIGINT = 2
PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3


def guard_self():
    """Make the runner non-dumpable and deaf to SIGINT (see the module doc); an error message, or None."""
    _signal.signal(SIGINT, _signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        return f"cannot make the runner non-dumpable (errno {ctypes.get_errno()})"
    return None


def apply_limits(lim):
    mb = 1 << 20
    for res, value in (
        (resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),  # soft: SIGXCPU, hard: SIGKILL
        (resource.RLIMIT_AS, (lim["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_NPROC, (lim["nproc"],) * 2),  # counted in the sandbox's own user namespace
        (resource.RLIMIT_FSIZE, (lim["file_size_kb"] * 1024,) * 2),
        (resource.RLIMIT_NOFILE, (lim["nofile"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(res, value)


def child(code, test, lim, value_w, out, err, k):
    """The forked test process: never returns."""
    try:
        os.setsid()  # its own process group: the runner kills the group on timeout
        # the program's own Ctrl-C behaviour, not the runner's
        _signal.signal(SIGINT, _signal.default_int_handler)
        stdin = os.open("/dev/null", os.O_RDONLY)
        if test["kind"] == "io":
            path = f"/tmp/in_{k}"
            with open(path, "w") as f:
                f.write(test.get("stdin", ""))
            stdin = os.open(path, os.O_RDONLY)
        for fd, target in ((stdin, 0), (out, 1), (err, 2), (value_w, 3)):
            os.dup2(fd, target)
        os.closerange(4, 1 << 16)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        apply_limits(lim)
    except BaseException as e:  # the set-up failed (a full /tmp): report it as this test's error
        os.write(value_w, json.dumps({"error": f"sandbox setup: {type(e).__name__}: {e}"}).encode())
        os._exit(70)
    try:
        namespace = {"__name__": "__main__" if test["kind"] == "io" else "solution"}
        try:
            exec(compile(code, "solution.py", "exec"), namespace)
        except SystemExit as e:  # a script that exits 0 has run; anything else is a failure
            if test["kind"] != "io" or e.code not in (None, 0):
                raise
        if test["kind"] == "call":
            fn = namespace.get(test["fn"])
            if not callable(fn):
                raise NameError(f"the program defines no function {test['fn']!r}")
            payload = {"value": fn(*test.get("args", []), **test.get("kwargs", {}))}
        else:
            payload = {"value": None}
        sys.stdout.flush()
        sys.stderr.flush()
        data = json.dumps(payload).encode()
    except BaseException as e:
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        data = json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]}).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(3, view) :]
    os._exit(0)


def read_capped(fd, buf, cap):
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return True
    if not chunk:
        return False
    if len(buf) <= cap:
        buf.extend(chunk)
    return True


def run_test(code, test, lim, k):
    value_r, value_w = os.pipe()
    out, err = os.memfd_create(f"out_{k}"), os.memfd_create(f"err_{k}")
    start = time.monotonic()
    try:
        pid = os.fork()
    except OSError as e:  # the program's processes fill the sandbox (a fork bomb): this test cannot start
        for fd in (value_r, value_w, out, err):
            os.close(fd)
        return {
            "time_s": 0.0,
            "stdout": "",
            "stderr": "",
            "status": "error",
            "error": f"cannot start the test: {e}",
        }
    if pid == 0:
        os.close(value_r)
        child(code, test, lim, value_w, out, err, k)
    os.close(value_w)
    os.set_blocking(value_r, False)
    pidfd = os.pidfd_open(pid)
    deadline = start + lim["test_timeout_s"]
    buf, timed_out, status, pipe_open = bytearray(), False, None, True
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            for target in (-pid, pid):  # its group, then itself if it left the group
                try:
                    os.kill(target, SIGKILL)
                except ProcessLookupError:
                    pass
            status = os.waitpid(pid, 0)[1]
            break
        ready, _, _ = select.select([value_r, pidfd] if pipe_open else [pidfd], [], [], left)
        if value_r in ready:
            pipe_open = read_capped(value_r, buf, lim["value_bytes"])
        if pidfd in ready:
            status = os.waitpid(pid, 0)[1]
    while pipe_open and read_capped(value_r, buf, lim["value_bytes"]):
        if not select.select([value_r], [], [], 0)[0]:  # a grandchild holds it open: take what is there
            break
    os.close(value_r)
    os.close(pidfd)
    elapsed = time.monotonic() - start
    kill_the_rest()
    # an io test's verdict reads its whole stdout (the file-size limit bounds it); otherwise the pool keeps
    # only output_chars of each: the reply stays inside the bound the pool reads it with
    # (asyncrl.sandbox.pool)
    out_cap = lim["file_size_kb"] * 1024 if test["kind"] == "io" else lim["output_chars"]
    result = {
        "time_s": round(elapsed, 6),
        "stdout": drain(out, out_cap),
        "stderr": drain(err, lim["output_chars"]),
    }
    if timed_out:
        return {
            **result,
            "status": "timeout",
            "error": f"over the {lim['test_timeout_s']} s test time limit",
        }
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = SIGNALS.get(sig, "a signal")
        verdict = "denied_syscall" if sig == SIGSYS else "error"
        return {**result, "status": verdict, "error": f"killed by signal {sig} ({name})"}
    if len(buf) > lim["value_bytes"]:
        return {**result, "status": "error", "error": f"return value over {lim['value_bytes']} bytes"}
    try:
        payload = json.loads(bytes(buf))
    except ValueError:
        return {**result, "status": "error", "error": "no result (the process ended before reporting one)"}
    if "error" in payload:
        return {**result, "status": "error", "error": str(payload["error"])}
    return {**result, "status": "ok", "value": payload.get("value")}


def drain(fd, cap):
    """The first ``cap`` bytes a test wrote to the memory file ``fd``, decoded; the file closed."""
    try:
        data = os.pread(fd, cap, 0)
    except OSError:
        data = b""
    os.close(fd)
    return data.decode("utf-8", "replace")


def kill_the_rest():
    """Kill every process of the namespace but the runner (what a test left running), then reap them."""
    try:
        os.kill(-1, SIGKILL)
    except ProcessLookupError:  # nothing was left
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main():
    out = os.fdopen(os.dup(1), "w")
    refusal = guard_self()
    out.write(f"refused: {refusal}\n" if refusal else "ready\n")
    out.flush()
    if refusal:
        return
    line = sys.stdin.readline()
    if not line:  # the pool went away before giving a job
        return
    job = json.loads(line)
    results = [run_test(job["code"], test, job["limits"], k) for k, test in enumerate(job["tests"])]
    out.write(json.dumps({"tests": results}) + "\n")
    out.flush()


if __name__ == "__main__":  # run as `python -c <source>`
    main()
