"""The program that runs *inside* the sandbox (standard library only; never imported by asyncrl itself).

``asyncrl.sandbox.pool`` starts it under bubblewrap (and its seccomp filter) as ``python -I -S -B -c <this
source>`` before any job exists (a pre-warmed worker): it prints ``ready``, then reads one job as a JSON line on
stdin (``memory_mb`` is the address space the pool gives each process, see ``asyncrl.sandbox.bounds``)::

    {"code": "...", "tests": [{"kind": "call", "fn": "f", "args": [...], "kwargs": {}},
                              {"kind": "io", "stdin": "..."}],
     "limits": {"cpu_s": 2, "memory_mb": 512, "nproc": 16, "file_size_kb": 1024, "nofile": 64,
                "test_timeout_s": 2.0, "value_bytes": 1048576}}

and answers one JSON line ``{"tests": [...]}``, one entry per test, then exits (one job per sandbox: every
program gets a fresh namespace). It is the PID namespace's init: nothing in the sandbox can kill it, and its
exit kills whatever the program left running. Each test runs in its own forked child under the rlimits, with stdout and
stderr going to files in the sandbox's private /tmp (the file-size limit bounds them). A ``call`` test
sends back the function's return value, an ``io`` test its stdout; the expected values never enter the
sandbox, so nothing running in here can forge a pass (the verdict is taken outside, in ``asyncrl.sandbox``).
"""

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


def child(code, test, lim, value_w, k):
    """The forked test process: never returns."""
    try:
        os.setsid()  # its own process group: the runner kills the group on timeout
        stdin = os.open("/dev/null", os.O_RDONLY)
        if test["kind"] == "io":
            path = f"/tmp/in_{k}"
            with open(path, "w") as f:
                f.write(test.get("stdin", ""))
            stdin = os.open(path, os.O_RDONLY)
        out = os.open(f"/tmp/out_{k}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(f"/tmp/err_{k}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
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


def reap_orphans():
    """Collect the zombies of processes a program left (the runner is its namespace's init, their parent now):
    each counts against the process limit until reaped."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def run_test(code, test, lim, k):
    reap_orphans()
    value_r, value_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(value_r)
        child(code, test, lim, value_w, k)
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
    result = {"time_s": round(elapsed, 6), "stdout": tail(f"/tmp/out_{k}"), "stderr": tail(f"/tmp/err_{k}")}
    if timed_out:
        return {**result, "status": "timeout", "error": f"over the {lim['test_timeout_s']} s test time limit"}
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


def tail(path):
    """The file's content (the file-size limit bounds it), then removed to free the private /tmp."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        os.unlink(path)
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def main():
    out = os.fdopen(os.dup(1), "w")
    out.write("ready\n")
    out.flush()
    line = sys.stdin.readline()
    if not line:  # the pool went away before giving a job
        return
    job = json.loads(line)
    results = [run_test(job["code"], test, job["limits"], k) for k, test in enumerate(job["tests"])]
    out.write(json.dumps({"tests": results}) + "\n")
    out.flush()


if __name__ == "__main__":  # run as `python -c <source>`
    main()
