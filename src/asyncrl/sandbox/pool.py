"""A pool of pre-warmed sandboxes that runs untrusted Python against tests and takes the verdicts outside.

``Sandbox.run(code, tests)`` hands the program to a sandbox that is already started (bubblewrap and the
runner's interpreter start in ~25 ms, paid ahead of time; ``python benchmarks/sandbox.py --workers 1`` shows
the rate one sandbox starts at in its busy phase), waits for its per-test results under a wall-clock
deadline, then kills the sandbox's PID namespace (nothing it started survives) and starts a replacement in
the background. Each test's expected value stays in this process: the sandbox reports what the program
returned or printed, and :func:`matches` decides, so no program can forge a pass. Thread-safe and
synchronous: the orchestrator calls it from its reward threads.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from importlib.resources import files
from typing import Any

from asyncrl.config.fields import F
from asyncrl.sandbox.bounds import SIGSYS, Enclosure, plan, seccomp_fd
from asyncrl.sandbox.health import CANARY, CANARY_TESTS, CrashWatch
from asyncrl.sandbox.isolation import (
    SandboxUnavailable,
    bwrap_binary,
    command,
    interpreter,
    reachable_bwrap,
    run_as,
)
from asyncrl.sandbox.verdict import RunResult, TestCase, TestResult, matches, reply_bound

log = logging.getLogger("asyncrl.sandbox")


@dataclass
class Limits:
    """What one program may use. CPU, file size and open files are per process (rlimits); memory, processes
    and CPUs are bounded for the sandbox as a whole too (see :mod:`asyncrl.sandbox.bounds`)."""

    timeout_s: float = F(20.0, "wall-clock limit for the whole program, every test included", gt=0)
    test_timeout_s: float = F(2.0, "wall-clock limit per test", gt=0)
    cpu_s: int = F(2, "CPU seconds per test process (SIGXCPU, then SIGKILL a second later)", ge=1)
    memory_mb: int = F(
        512, "address space per process at most, MiB (less where rlimits hold sandbox_memory_mb)", ge=64
    )
    sandbox_memory_mb: int = F(
        2048, "memory of one sandbox: all its processes and its /tmp together, MiB", ge=128
    )
    pool_memory_mb: int = F(0, "memory of the pool's sandboxes together, MiB (0 = half the machine's)", ge=0)
    nproc: int = F(16, "processes and threads in the sandbox", ge=4)
    cpus: int = F(1, "CPUs one sandbox's processes share (its cgroup's cpu.max, else pinned to them)", ge=1)
    file_size_kb: int = F(1024, "largest file a test may write (its stdout and stderr included), KiB", ge=1)
    nofile: int = F(64, "open files per process", ge=16)
    tmpfs_mb: int = F(64, "size of the sandbox's private /tmp, MiB", ge=1)
    output_chars: int = F(4096, "stdout/stderr characters kept per test in the result", ge=0)
    value_bytes: int = F(1 << 20, "largest return value (JSON) a call test may send back", ge=64)


class _Worker:
    """One started sandbox, waiting for its job."""

    def __init__(
        self, argv: list[str], info_r: int, info_w: int, filter_r: int, user: tuple[int, int] | None
    ):
        kwargs: dict[str, Any] = {"user": user[0], "group": user[1], "extra_groups": []} if user else {}
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # a pipe, read only if start-up fails: after that nothing of ours writes there, and a program
            # that reached the runner's stderr (/proc/<pid>/fd/2) blocks on a full pipe, where a file would
            # fill the disk
            stderr=subprocess.PIPE,
            env={},  # nothing of ours, not even for bwrap
            pass_fds=(info_w, filter_r),
            start_new_session=True,
            **kwargs,
        )
        os.close(info_w)
        os.close(filter_r)
        self.group: Any = None  # its cgroup, once enclosed
        self.last_words = ""  # the end of its stderr, once killed
        with os.fdopen(info_r) as info:  # bwrap writes the sandbox's first process (the namespace's init)
            text = info.read()
        self.init_pid = json.loads(text)["child-pid"] if text.strip() else None
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if first != b"ready\n":
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            self.kill()
            raise SandboxUnavailable(
                f"the sandbox did not start: {(first.decode(errors='replace') + err).strip()}"
            )

    def _stderr_tail(self, keep: int = 300) -> str:
        """The last line bwrap or the runner wrote to stderr (a runner's traceback ends with its error), read
        once they are gone: at most a pipe's buffer is there, and no writer is left to block the read."""
        try:
            data = self.proc.stderr.read(1 << 16) if self.proc.stderr is not None else b""
        except (OSError, ValueError):
            return ""
        lines = data.decode(errors="replace").strip().splitlines()
        return lines[-1][-keep:] if lines else ""

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
        self.last_words = self._stderr_tail()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:  # unflushed input to a sandbox that is gone
                pass


class Sandbox:
    """A pool of ``workers`` pre-warmed sandboxes (default: one per CPU, as many as ``pool_memory_mb``
    holds). ``run`` waits for a warm one: under a sustained load, runs go at the rate sandboxes can be
    started (see benchmarks/sandbox.py). ``cgroup``: a delegated cgroup v2 directory (see
    :mod:`asyncrl.sandbox.bounds`); ``parts``: how many pools like this one share the machine's budget (one
    per env worker process); ``crash_rate`` of the last ``crash_window`` runs crashed: the canary decides
    (:mod:`asyncrl.sandbox.health`).

    Raises :class:`SandboxUnavailable` at construction if isolation cannot be set up here, ``ValueError`` if
    the memory keys do not fit together."""

    def __init__(
        self,
        limits: Limits | None = None,
        workers: int = 0,
        bwrap: str = "",
        python: str = "",
        cgroup: str = "",
        parts: int = 1,
        crash_rate: float = 0.5,
        crash_window: int = 16,
    ):
        self.limits = limits or Limits()
        self._watch = CrashWatch(crash_rate, crash_window)
        self._failing: SandboxUnavailable | None = None  # set once the canary failed
        self.plan = plan(self.limits, workers, cgroup, parts)
        self.size = self.plan.workers
        how = (
            f"its own cgroup under {self.plan.cgroup}"
            if self.plan.cgroup
            else f"rlimits: {self.limits.nproc} processes x {self.plan.process_mb} MiB address space + /tmp"
        )
        log.info(
            f"sandbox pool: {self.size} x {self.plan.sandbox_mb} MiB of {self.plan.pool_mb} MiB; each "
            f"sandbox held by {how} ({self.plan.why}); seccomp filter on"
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
        # Sandboxes are started by long-lived threads, one per warm slot (starting one is ~25 ms of CPU,
        # mostly the interpreter's): bwrap's --die-with-parent follows the *thread* that forked it
        # (PR_SET_PDEATHSIG), so a sandbox started by a short-lived thread would die with it.
        self._warmers = [
            threading.Thread(target=self._warmer, args=(k,), daemon=True, name=f"sandbox-warm-{k}")
            for k in range(self.size)
        ]
        for thread in self._warmers:
            thread.start()
        self._orders.put(True)  # the probe
        try:
            # the probe: raises SandboxUnavailable here, before any program runs
            self._ready.put(self._take())
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
                f"{e}\n(bwrap={self.bwrap}, python={self.python}, as uid "
                f"{self.user[0] if self.user else os.getuid()}"
                "); untrusted code needs user namespaces: in Docker run with `--security-opt "
                "seccomp=unconfined --security-opt apparmor=unconfined`; on Ubuntu 24.04 allow them for "
                "bwrap (`sysctl kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor profile)"
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
        """Run ``code`` against ``tests`` in a fresh sandbox. Never raises for anything the program does;
        raises :class:`SandboxUnavailable` once crashes and a failed canary show the sandbox itself failing
        (:mod:`asyncrl.sandbox.health`)."""
        if self._closed:
            raise RuntimeError("the sandbox pool is closed")
        if self._failing is not None:
            raise self._failing
        result = self._run_in(self._next(), code, tests)
        if result.status == "crashed":
            log.warning(f"a sandbox crashed: {result.error}")
        if self._watch.record(result):
            canary = self._run_in(self._next(), CANARY, CANARY_TESTS)
            if why := self._watch.verdict(canary):
                self._failing = SandboxUnavailable(why)
                log.error(str(self._failing))
                raise self._failing
            log.warning(
                f"sandboxes crashed often, and the canary passed: the programs' own doing ({result.error})"
            )
        return result

    def _next(self) -> _Worker:
        try:
            return self._take()  # FIFO: runs are served in the order they asked
        finally:
            # warm the next one while this one runs; after a sandbox that failed to start too, or the pool
            # would lose the slot and a retry would wait for a sandbox nobody starts
            self._orders.put(True)

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
            # one line; the runner writes nothing else on this pipe
            line = worker.proc.stdout.readline(bound + 1)
            if len(line) > bound:
                status, error = (
                    "over_limit",
                    f"the sandbox's reply is over the {bound} bytes its tests can produce",
                )
            else:
                reply = json.loads(line) if line else {}
        # the sandbox died mid-job (killed by the deadline, or by its program)
        except (OSError, ValueError) as e:
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
            ended = (
                f" (bwrap exit {worker.proc.returncode}: {worker.last_words})" if status == "crashed" else ""
            )
            error = error or (
                f"over the {lim.timeout_s} s limit"
                if status == "timeout"
                else "the sandbox ended without results"
            )
            error += ended
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
