"""The sandbox bounded as a whole: its memory (every process and its /tmp together, measured from outside
while the program runs), the pool's memory across sandboxes, and the system calls the seccomp filter
kills."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

from asyncrl.sandbox import Limits, Sandbox, SandboxUnavailable, TestCase
from asyncrl.sandbox.bounds import OVERHEAD_MB, plan

# shrunk: a 640 MiB sandbox of 12 processes leaves each (640 - 8 - 1 - 32) / 11 = 54 MiB... too little for a
# test that wants a fork to matter, so 1024: 89 MiB each where rlimits hold it
LIMITS = Limits(
    timeout_s=8.0, test_timeout_s=2.5, cpu_s=2, memory_mb=256, sandbox_memory_mb=1024, nproc=12, tmpfs_mb=8
)
MB = 1 << 20

# forks as many children as the sandbox allows, and each (the parent too) touches memory until it can take no
# more, then waits: unbounded as a whole, 11 processes x 256 MiB
FORK_AND_TOUCH = """
import os, time
def touch():
    for _ in range(40):
        try:
            if os.fork() == 0:
                break
        except OSError:
            break
    hold = []
    try:
        while True:
            hold.append(b"x" * (4 << 20))
    except MemoryError:
        pass
    time.sleep(60)
f = touch
"""

# fills /tmp first (file by file: a file is capped at file_size_kb), then the same
FILL_TMP = (
    FORK_AND_TOUCH
    + """
def f():
    k = 0
    try:
        while True:
            with open(f"/tmp/fill_{k}", "wb") as out:
                out.write(b"y" * (200 << 10))
            k += 1
    except OSError:
        pass
    touch()
"""
)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(LIMITS, workers=2) as sb:
        yield sb


def sandboxes_of(pool: Sandbox) -> list[psutil.Process]:
    """The bwrap process of every sandbox the pool holds now, warm or running."""
    return [psutil.Process(w.proc.pid) for w in list(pool._live) if psutil.pid_exists(w.proc.pid)]


def host_memory(bwrap: psutil.Process) -> tuple[int, int]:
    """What one sandbox takes from the host now: the resident memory of bwrap and every process in the
    sandbox (a stricter sum than PSS: pages shared between forks count in each), and its tmpfs use."""
    try:
        procs = [bwrap, *bwrap.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    rss = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
        except psutil.Error:
            pass
    tmpfs = 0
    if len(procs) > 1:
        for mount in ("tmp", "dev/shm"):
            try:
                st = os.statvfs(f"/proc/{procs[1].pid}/root/{mount}")
                tmpfs += (st.f_blocks - st.f_bfree) * st.f_frsize
            except OSError:
                pass
    return rss, tmpfs


class Peak:
    """Samples the pool's sandboxes from outside while programs run: the largest total, per sandbox and for
    all of them at once."""

    def __init__(self, pool: Sandbox):
        self.pool, self.one, self.all, self.tmpfs = pool, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.wait(0.02):
            sizes = [host_memory(b) for b in sandboxes_of(self.pool)]
            self.one = max([self.one, *(r + t for r, t in sizes)])
            self.all = max(self.all, sum(r + t for r, t in sizes))
            self.tmpfs = max([self.tmpfs, *(t for _, t in sizes)])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run(pool: Sandbox, code: str, expected=None):
    return pool.run(code, [TestCase("call", expected, fn="f")])


def test_forked_children_that_touch_memory_stay_under_the_sandboxs_budget(sandbox):
    with Peak(sandbox) as peak:
        r = run(sandbox, FORK_AND_TOUCH)
    assert r.fraction_passed == 0 and r.tests[0].status == "timeout"
    # the attack was real: far beyond one process's share, close to the whole budget
    assert peak.one > 0.6 * LIMITS.sandbox_memory_mb * MB, peak.one / MB
    assert peak.one <= LIMITS.sandbox_memory_mb * MB, peak.one / MB


def test_a_full_tmp_counts_in_the_budget(sandbox):
    with Peak(sandbox) as peak:
        r = run(sandbox, FILL_TMP)
    assert r.fraction_passed == 0
    assert peak.tmpfs >= 0.9 * LIMITS.tmpfs_mb * MB, peak.tmpfs / MB
    assert peak.one <= LIMITS.sandbox_memory_mb * MB, peak.one / MB


def test_sandboxes_at_once_stay_under_the_pool_budget():
    # each program holds its memory until its test's timeout: 6 s, longer than LIMITS', so that the two
    # overlap even when one sandbox starts seconds after the other on busy cores
    pool_mb = 2 * LIMITS.sandbox_memory_mb
    limits = Limits(**{**vars(LIMITS), "pool_memory_mb": pool_mb, "test_timeout_s": 6.0})
    with Sandbox(limits, workers=2) as pool, Peak(pool) as peak:
        threads = [threading.Thread(target=run, args=(pool, FORK_AND_TOUCH)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert peak.all > 1.2 * LIMITS.sandbox_memory_mb * MB, peak.all / MB  # both ran at once
    assert peak.all <= limits.pool_memory_mb * MB, peak.all / MB


def test_memory_keys_that_do_not_fit_together_are_refused_by_name():
    fits_two = Limits(sandbox_memory_mb=1024, pool_memory_mb=2048, nproc=8)
    with pytest.raises(ValueError, match=r"workers=3 x sandbox_memory_mb=1024 is over pool_memory_mb=2048"):
        Sandbox(fits_two, workers=3)
    # as many as fit, one per CPU at most
    assert plan(fits_two, 0).workers == min(2, len(os.sched_getaffinity(0)))
    small = Limits(sandbox_memory_mb=256, nproc=16, tmpfs_mb=64)
    if plan(Limits(), 1).cgroup is None:  # rlimits hold the budget here: a process's share is too small
        with pytest.raises(ValueError, match=r"sandbox_memory_mb=256 leaves 10 MiB per process .*nproc=16"):
            plan(small, 1)
    assert OVERHEAD_MB < LIMITS.sandbox_memory_mb


def test_pools_of_env_workers_share_one_budget():
    """One pool per env worker process: together they hold what one pool would (workers, memory, CPUs)."""
    limits = Limits(sandbox_memory_mb=1024, pool_memory_mb=4096, nproc=8)
    assert plan(limits, 4, parts=2).workers == 2
    assert plan(limits, 3, parts=4).workers == 1  # every worker process keeps a sandbox
    assert plan(limits, 0, parts=2).pool_mb == 2048
    assert plan(limits, 0, parts=2).workers == max(1, min(len(os.sched_getaffinity(0)) // 2, 2))
    with pytest.raises(ValueError, match=r"pool_memory_mb=1024 .*shared by 4 env worker processes"):
        plan(Limits(sandbox_memory_mb=512, pool_memory_mb=4096, nproc=8), 12, parts=4)


def test_a_named_cgroup_without_the_memory_controller_is_refused(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")  # a group whose parent delegated neither
    with pytest.raises(
        SandboxUnavailable, match=r"cgroup=.*without the \{'(memory|pids)', '(memory|pids)'\}"
    ):
        Sandbox(LIMITS, workers=1, cgroup=str(tmp_path))


def test_ptrace_on_the_runner_is_killed_at_once_and_counted(sandbox):
    start = time.monotonic()
    r = run(sandbox, "import ctypes\ndef f():\n    return ctypes.CDLL(None).ptrace(16, 1, 0, 0)\n", 0)
    assert time.monotonic() - start < 1.5  # the deadline is LIMITS.timeout_s: ptrace stopped nothing
    assert r.status == "denied_syscall" and r.fraction_passed == 0
    assert r.tests[0].status == "denied_syscall" and "SIGSYS" in r.tests[0].error


@pytest.mark.parametrize(
    "call",
    [
        "ctypes.CDLL(None).unshare(0x40000000)",  # a network namespace
        "ctypes.CDLL(None).syscall(56, 0x20000000 | 17, 0, 0, 0, 0)",  # clone into a new PID namespace
        "ctypes.CDLL(None).syscall(425, 8, 0)",  # io_uring_setup
        "ctypes.CDLL(None).syscall(323, 0)",  # userfaultfd
        "ctypes.CDLL(None).mount(b'none', b'/tmp', b'tmpfs', 0, None)",
    ],
)
def test_denied_system_calls_fail_the_program(sandbox, call):
    # a second test that would pass: a denied call in one test fails them all
    r = sandbox.run(
        f"import ctypes\ndef f():\n    return {call}\ndef g():\n    return 1\n",
        [TestCase("call", 0, fn="f"), TestCase("call", 1, fn="g")],
    )
    assert r.status == "denied_syscall" and r.fraction_passed == 0


def test_ordinary_programs_still_run(sandbox):
    programs = {
        "import threading\ndef f():\n    out = []\n    ts = [threading.Thread(target=out.append, args=(1,)) "
        "for _ in range(4)]\n    [t.start() for t in ts]\n    [t.join() for t in ts]\n"
        "    return len(out)\n": 4,
        "import subprocess\ndef f():\n    return subprocess.run(['/bin/echo', 'hi'], capture_output=True, "
        "text=True).stdout\n": "hi\n",
        "import multiprocessing as mp\ndef put(q):\n    q.put(7)\ndef f():\n    q = mp.Queue()\n"
        "    p = mp.Process(target=put, args=(q,))\n    p.start()\n    v = q.get()\n    p.join()\n"
        "    return v\n": 7,
        # the CPU bound holds: widening the sandbox's CPUs is refused, not fatal
        "import os\ndef f():\n    try:\n        os.sched_setaffinity(0, range(os.cpu_count()))\n"
        "    except PermissionError:\n        return 'refused'\n": "refused",
    }
    for code, expected in programs.items():
        r = run(sandbox, code, expected)
        assert r.fraction_passed == 1.0, (code, r.tests[0])


# while four threads wait at a barrier, the program reads its address space; after they end, the peak: the
# difference is what came and went in between, which a per-process address-space rlimit also counts
THREADS_PEAK = """
import threading
def vm(key):
    return int(next(line.split()[1] for line in open('/proc/self/status') if line.startswith(key)))
def f():
    gate = threading.Barrier(5)
    ts = [threading.Thread(target=gate.wait) for _ in range(4)]
    [t.start() for t in ts]
    alive = vm('VmSize')
    gate.wait()
    [t.join() for t in ts]
    print(vm('VmPeak') - alive)
"""


def test_threads_reserve_no_address_space_beyond_their_stacks(sandbox):
    # glibc gives each new thread a malloc arena, first reserving 64 MiB it then lets go: with rlimits
    # holding ~89 MiB per process here, another thread starting at that moment fails ("can't start new
    # thread")
    r = run(sandbox, THREADS_PEAK)
    assert r.tests[0].status == "ok", r.tests[0]
    assert int(r.tests[0].stdout) < 1024, f"{r.tests[0].stdout.strip()} KiB came and went"
