"""A pool of pre-warmed sandboxes that runs untrusted Python against tests and takes the verdicts outside.

``Sandbox.run(code, tests)`` hands the program to a sandbox that is already started (bubblewrap and the
runner's interpreter start in ~25 ms, paid ahead of time; ``python benchmarks/sandbox.py --workers 1`` shows
the rate one sandbox starts at in its busy phase), waits for its per-test results under a wall-clock
deadline, then kills the sandbox's PID namespace (nothing it started survives) and starts a replacement in the
background. Each test's expected value stays in this process: the sandbox reports what the program returned
or printed, and :func:`matches` decides, so no program can forge a pass. Thread-safe and synchronous: the
orchestrator calls it from its reward threads.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from typing import Any

from asyncrl.config.fields import F
from asyncrl.sandbox.bounds import SIGSYS, Enclosure, plan, seccomp_fd
from asyncrl.sandbox.isolation import (
    SandboxUnavailable,
    bwrap_binary,
    command,
    interpreter,
    reachable_bwrap,
    run_as,
)

log = logging.getLogger("asyncrl.sandbox")


@dataclass
class Limits:
    """What one program may use. CPU, file size and open files are per process (rlimits); memory, processes
    and CPUs are bounded for the sandbox as a whole too (see :mod:`asyncrl.sandbox.bounds`)."""

    timeout_s: float = F(20.0, "wall-clock limit for the whole program, every test included", gt=0)
    test_timeout_s: float = F(2.0, "wall-clock limit per test", gt=0)
    cpu_s: int = F(2, "CPU seconds per test process (SIGXCPU, then SIGKILL a second later)", ge=1)
    memory_mb: int = F(512, "address space per process at most, MiB (less where rlimits hold sandbox_memory_mb)", ge=64)
    sandbox_memory_mb: int = F(2048, "memory of one sandbox: all its processes and its /tmp together, MiB", ge=128)
    pool_memory_mb: int = F(0, "memory of the pool's sandboxes together, MiB (0 = half the machine's)", ge=0)
    nproc: int = F(16, "processes and threads in the sandbox", ge=4)
    cpus: int = F(1, "CPUs one sandbox's processes share (its cgroup's cpu.max, else pinned to them)", ge=1)
    file_size_kb: int = F(1024, "largest file a test may write (its stdout and stderr included), KiB", ge=1)
    nofile: int = F(64, "open files per process", ge=16)
    tmpfs_mb: int = F(64, "size of the sandbox's private /tmp, MiB", ge=1)
    output_chars: int = F(4096, "stdout/stderr characters kept per test in the result", ge=0)
    value_bytes: int = F(1 << 20, "largest return value (JSON) a call test may send back", ge=64)


@dataclass
class TestCase:
    """One hidden test: ``call`` (``fn(*args, **kwargs)`` must equal ``expected``) or ``io`` (the program run
    as a script on ``stdin`` must print ``expected``, compared line by line without trailing whitespace)."""

    __test__ = False  # not a pytest test class

    kind: str
    expected: Any
    fn: str = ""
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    stdin: str = ""

    def __post_init__(self):
        if self.kind not in ("call", "io"):
            raise ValueError(f"test kind {self.kind!r}: allowed values are 'call', 'io'")
        if self.kind == "call" and not self.fn:
            raise ValueError("a call test needs the function's name (fn)")

    def job(self) -> dict[str, Any]:
        """What enters the sandbox: the inputs, never ``expected``."""
        if self.kind == "call":
            return {"kind": "call", "fn": self.fn, "args": self.args, "kwargs": self.kwargs}
        return {"kind": "io", "stdin": self.stdin}


@dataclass
class TestResult:
    passed: bool
    status: str  # ok (ran to the end; passed says whether it was right), error, timeout, denied_syscall (SIGSYS)
    time_s: float
    stdout: str = ""
    stderr: str = ""
    error: str = ""


@dataclass
class RunResult:
    tests: list[TestResult]
    wall_s: float
    # ok, timeout (the whole program), crashed (the sandbox ended without results), denied_syscall (a test's
    # process was killed by the seccomp filter: every test fails), over_limit (a reply longer than its tests can
    # produce: every test fails). Each is counted by the environment that scores with it (envs/code.py)
    status: str = "ok"
    error: str = ""

    @property
    def fraction_passed(self) -> float:
        return sum(t.passed for t in self.tests) / len(self.tests) if self.tests else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fraction_passed": self.fraction_passed}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def matches(test: TestCase, reported: dict[str, Any]) -> bool:
    """The verdict on one test, from what the sandbox reported (untrusted) and the expected value (ours).
    Values are compared as JSON (tuples are lists; floats to a relative 1e-9)."""
    if reported.get("status") != "ok":
        return False
    if test.kind == "io":
        return isinstance(reported.get("stdout"), str) and _lines(reported["stdout"]) == _lines(str(test.expected))
    return _same(reported.get("value"), json.loads(json.dumps(test.expected)))


# JSON's worst case for text: a byte that is not UTF-8 decodes to U+FFFD, which json.dumps writes as 6 bytes
JSON_TEXT_GROWTH = 6
REPLY_SLACK = 1024  # per test: the field names, status, time and error


def reply_bound(lim: Limits, tests: list[TestCase]) -> int:
    """The most bytes the runner's reply to ``tests`` can hold (pure): per test, its stdout (an io test's whole
    output, the file-size limit; otherwise ``output_chars``) and stderr (``output_chars``) as JSON text, and its
    value (``value_bytes``, re-serialised: twice that covers a float's longer spelling), plus slack."""
    per_test = []
    for t in tests:
        out = lim.file_size_kb * 1024 if t.kind == "io" else lim.output_chars
        text = JSON_TEXT_GROWTH * (out + lim.output_chars)
        per_test.append(text + 2 * lim.value_bytes + REPLY_SLACK)
    return sum(per_test) + REPLY_SLACK


class _Worker:
    """One started sandbox, waiting for its job."""

    def __init__(self, argv: list[str], info_r: int, info_w: int, filter_r: int, user: tuple[int, int] | None):
        kwargs: dict[str, Any] = {"user": user[0], "group": user[1], "extra_groups": []} if user else {}
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # a pipe, read only if start-up fails: after that nothing of ours writes there, and a program that
            # reached the runner's stderr (/proc/<pid>/fd/2) blocks on a full pipe, where a file would fill the disk
            stderr=subprocess.PIPE,
            env={},  # nothing of ours, not even for bwrap
            pass_fds=(info_w, filter_r),
            start_new_session=True,
            **kwargs,
        )
        os.close(info_w)
        os.close(filter_r)
        self.group: Any = None  # its cgroup, once enclosed
        with os.fdopen(info_r) as info:  # bwrap writes the sandbox's first process (the namespace's init)
            text = info.read()
        self.init_pid = json.loads(text)["child-pid"] if text.strip() else None
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if first != b"ready\n":
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            self.kill()
            raise SandboxUnavailable(f"the sandbox did not start: {(first.decode(errors='replace') + err).strip()}")

    def kill(self) -> None:
        """End the sandbox and everything in it. Killing the PID namespace's init kills every process in the
        namespace; bwrap, its parent, then reaps it and exits, so once bwrap is reaped nothing of the sandbox
        is left. bwrap itself is killed only if that does not happen in time."""
        for pid in (self.init_pid, -self.proc.pid):
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                log.warning(f"sandbox {self.proc.pid}: still running 5 s after SIGKILL to {pid}")
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:  # unflushed input to a sandbox that is gone
                pass


class Sandbox:
    """A pool of ``workers`` pre-warmed sandboxes (default: one per CPU, as many as ``pool_memory_mb`` holds).
    ``run`` waits for a warm one: under a sustained load, runs go at the rate sandboxes can be started (see
    benchmarks/sandbox.py). ``cgroup``: a delegated cgroup v2 directory (see :mod:`asyncrl.sandbox.bounds`);
    ``parts``: how many pools like this one share the machine's budget (one per env worker process).

    Raises :class:`SandboxUnavailable` at construction if isolation cannot be set up here, ``ValueError`` if the
    memory keys do not fit together."""

    def __init__(
        self,
        limits: Limits | None = None,
        workers: int = 0,
        bwrap: str = "",
        python: str = "",
        cgroup: str = "",
        parts: int = 1,
    ):
        self.limits = limits or Limits()
        self.plan = plan(self.limits, workers, cgroup, parts)
        self.size = self.plan.workers
        how = (
            f"its own cgroup under {self.plan.cgroup}"
            if self.plan.cgroup
            else f"rlimits: {self.limits.nproc} processes x {self.plan.process_mb} MiB address space + /tmp"
        )
        log.info(
            f"sandbox pool: {self.size} x {self.plan.sandbox_mb} MiB of {self.plan.pool_mb} MiB; each sandbox held by "
            f"{how} ({self.plan.why}); seccomp filter on"
        )
        self._enclosure = Enclosure(self.plan, self.limits.cpus)
        self.user = run_as()
        self.python, prefix = interpreter(python, as_other_user=self.user is not None)
        self.bwrap = bwrap_binary(bwrap)
        if self.user is not None:
            self.bwrap = reachable_bwrap(self.bwrap)
        self._source = files("asyncrl.sandbox").joinpath("runner.py").read_text()
        self._argv = lambda fd, filter_fd: command(
            self.bwrap, self.python, prefix, self.limits.tmpfs_mb, self._source, fd, filter_fd
        )
        self._ready: queue.Queue[_Worker | BaseException] = queue.Queue()
        self._orders: queue.Queue[bool] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        # Sandboxes are started by long-lived threads, one per warm slot (starting one is ~25 ms of CPU, mostly
        # the interpreter's): bwrap's --die-with-parent follows the *thread* that forked it (PR_SET_PDEATHSIG),
        # so a sandbox started by a short-lived thread would die with it.
        self._warmers = [
            threading.Thread(target=self._warmer, args=(k,), daemon=True, name=f"sandbox-warm-{k}")
            for k in range(self.size)
        ]
        for thread in self._warmers:
            thread.start()
        self._orders.put(True)  # the probe
        try:
            self._ready.put(self._take())  # the probe: raises SandboxUnavailable here, before any program runs
        except BaseException:
            self.close()
            raise
        for _ in range(self.size - 1):
            self._orders.put(True)

    def _start(self, slot: int) -> _Worker:
        filter_r = seccomp_fd()
        info_r, info_w = os.pipe()
        try:
            worker = _Worker(self._argv(info_w, filter_r), info_r, info_w, filter_r, self.user)
        except SandboxUnavailable as e:
            raise SandboxUnavailable(
                f"{e}\n(bwrap={self.bwrap}, python={self.python}, as uid {self.user[0] if self.user else os.getuid()}"
                "); untrusted code needs user namespaces: in Docker run with `--security-opt seccomp=unconfined "
                "--security-opt apparmor=unconfined`; on Ubuntu 24.04 allow them for bwrap "
                "(`sysctl kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor profile)"
            ) from None
        try:
            pids = [worker.proc.pid] + ([worker.init_pid] if worker.init_pid is not None else [])
            worker.group = self._enclosure.enclose(slot, pids, self.limits.nproc)
        except OSError as e:
            worker.kill()
            raise SandboxUnavailable(f"the sandbox could not be bounded: {e}") from None
        with self._lock:
            self._live.add(worker)
            if self._closed:
                self._retire(worker)
        return worker

    def _warmer(self, slot: int) -> None:
        while self._orders.get() and not self._closed:
            try:
                self._ready.put(self._start(slot))
            except BaseException as e:  # handed to the next run(), which raises it
                self._ready.put(e)

    def _take(self) -> _Worker:
        got = self._ready.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        self._enclosure.release(worker.group)
        worker.group = None
        self._live.discard(worker)

    def run(self, code: str, tests: list[TestCase]) -> RunResult:
        """Run ``code`` against ``tests`` in a fresh sandbox. Never raises for anything the program does."""
        if self._closed:
            raise RuntimeError("the sandbox pool is closed")
        try:
            worker = self._take()  # FIFO: runs are served in the order they asked
        finally:
            # warm the next one while this one runs; after a sandbox that failed to start too, or the pool would
            # lose the slot and a retry would wait for a sandbox nobody starts
            self._orders.put(True)
        return self._run_in(worker, code, tests)

    def _run_in(self, worker: _Worker, code: str, tests: list[TestCase]) -> RunResult:
        lim = self.limits
        limits = {**asdict(lim), "memory_mb": self.plan.process_mb}
        job = {"code": code, "tests": [t.job() for t in tests], "limits": limits}
        start = time.monotonic()
        reply: dict[str, Any] = {}
        status, error = "ok", ""
        timer = threading.Timer(lim.timeout_s, worker.kill)  # the whole program's deadline
        timer.start()
        try:
            assert worker.proc.stdin is not None and worker.proc.stdout is not None
            worker.proc.stdin.write(json.dumps(job).encode() + b"\n")
            worker.proc.stdin.flush()
            bound = reply_bound(lim, tests)
            line = worker.proc.stdout.readline(bound + 1)  # one line; the runner writes nothing else on this pipe
            if len(line) > bound:
                status, error = "over_limit", f"the sandbox's reply is over the {bound} bytes its tests can produce"
            else:
                reply = json.loads(line) if line else {}
        except (OSError, ValueError) as e:  # the sandbox died mid-job (killed by the deadline, or by its program)
            error = f"{type(e).__name__}: {e}"
        finally:
            timer.cancel()
            with self._lock:
                self._retire(worker)
        wall = time.monotonic() - start
        reported = reply.get("tests") if isinstance(reply, dict) else None
        if status == "over_limit":
            reported = [{} for _ in tests]
        elif not isinstance(reported, list) or len(reported) != len(tests):
            reported = [{} for _ in tests]
            status = "timeout" if wall >= lim.timeout_s else "crashed"
            error = error or (
                f"over the {lim.timeout_s} s limit" if status == "timeout" else "the sandbox ended without results"
            )
        if any(r.get("status") == "denied_syscall" for r in reported):
            status, error = "denied_syscall", f"killed by signal {SIGSYS}: a system call the sandbox denies"
        results = [
            TestResult(
                passed=status != "denied_syscall" and matches(test, r),
                status=str(r.get("status", status)),
                time_s=float(r.get("time_s", 0.0)),
                stdout=str(r.get("stdout", ""))[: lim.output_chars],
                stderr=str(r.get("stderr", ""))[: lim.output_chars],
                error=str(r.get("error", error))[:2000],
            )
            for test, r in zip(tests, reported, strict=True)
        ]
        return RunResult(results, wall, status, error)

    def close(self) -> None:
        """Kill every sandbox, warm or running."""
        with self._lock:
            self._closed = True
            for _ in self._warmers:
                self._orders.put(False)
            for worker in list(self._live):
                self._retire(worker)
        for thread in self._warmers:  # a sandbox one was starting is retired by _start, seeing _closed
            thread.join()
        self._enclosure.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
