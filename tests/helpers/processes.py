"""Every process a test started, found by the process tree rather than by its command line.

A run's processes are not all recognisable by their argv: the CPU sidecar's engine, when spawned, runs
``python -c ... --multiprocessing-fork``; multiprocessing's resource tracker, vLLM's engine core and workers
and the sandbox's workers carry nothing of the run either. What they share is an ancestor. A process whose
parent dies is reparented to init (or the nearest subreaper) and drops out of that ancestor's tree, so
:class:`ProcessTree` samples the tree while the run is alive, again and again, and remembers every descendant
by PID and start time: one it saw stays known after it is orphaned, and a PID reused by an unrelated process
later is not mistaken for it.
"""

from __future__ import annotations

import threading

import psutil


class ProcessTree:
    """The descendants of ``pid`` seen so far; :meth:`watch` samples them in a thread until the root
    exits."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.seen: dict[tuple[int, float], psutil.Process] = {}  # (pid, create_time) -> process
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Add every live descendant of the root (nothing once the root is gone)."""
        try:
            children = self.root.children(recursive=True)
        except psutil.Error:  # the root exited: its orphans are no longer its descendants
            return
        for p in children:
            try:
                key = (p.pid, p.create_time())
            except psutil.Error:  # exited between the listing and the look-up
                continue
            with self._lock:
                self.seen.setdefault(key, p)

    def watch(self) -> ProcessTree:
        """Sample every ``interval_s`` in a daemon thread until the root exits or :meth:`stop` is called."""

        def loop() -> None:
            while not self._stop.is_set() and self.root.is_running():
                self.sample()
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=loop, name="process-tree", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def alive(self) -> list[psutil.Process]:
        """The descendants seen that still run: same PID and same start time, and not a zombie (an exited
        process whose new parent has not reaped it yet holds nothing but its PID)."""
        with self._lock:
            seen = list(self.seen.items())
        left = []
        for (pid, created), p in seen:
            try:
                if psutil.Process(pid).create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                continue
        return left


def describe(processes: list[psutil.Process]) -> list[str]:
    """``"pid: argv"`` per process, for a failure message."""
    out = []
    for p in processes:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            out.append(f"{p.pid}: (gone)")
    return out


def tree_memory(pid: int) -> dict[int, int]:
    """``{pid: bytes}`` of ``pid`` and every descendant: the proportional set size where the kernel gives it
    (a forked child shares its parent's pages until written; PSS splits each shared page between its sharers,
    so the sum counts each page once), else the resident set size."""
    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            info = p.memory_full_info()
            out[p.pid] = getattr(info, "pss", info.rss)
        except psutil.AccessDenied:
            out[p.pid] = p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return out
