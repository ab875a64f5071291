"""Telling a failing sandbox from failing programs: after too many crashes, a program known to pass decides.

A sandbox *crashes* when it ends without a result while its program had time left: the runner is out of the
program's reach (:mod:`asyncrl.sandbox.runner`), so a crash points at the machine (its memory, its disk, a
broken interpreter or bwrap) more than at the program. Scored 0, a wave of such crashes would train the
policy on zeros and look like a policy that got worse. So the pool watches the share of crashes among its
last runs; past ``crash_rate``, it runs :data:`CANARY`, a program that passes on any working sandbox. If the
canary passes too, the crashes were the programs' own and the run goes on; if it fails, the sandbox is what
fails: the pool raises :class:`SandboxUnavailable` with the canary's verdict and what to check, and every
later run raises it again, which stops the run (:class:`asyncrl.workers.scoring.Scorer`) instead of scoring
samples 0.
"""

from __future__ import annotations

import threading
from collections import deque

from asyncrl.sandbox.verdict import RunResult, TestCase

CANARY = "def f(x):\n    return x + 1\n"
CANARY_TESTS = [TestCase("call", 2, fn="f", args=[1]), TestCase("call", 11, fn="f", args=[10])]


class CrashWatch:
    """The share of crashed runs among the last ``window`` (a run that ends before ``window`` runs were seen
    is not judged); :meth:`record` says when the canary is due. Thread-safe: the pool's runs come from the
    reward threads."""

    def __init__(self, rate: float, window: int):
        self.rate, self.window = rate, window
        self.recent: deque[bool] = deque(maxlen=window)
        self.last_error = ""
        self._lock = threading.Lock()

    def record(self, result: RunResult) -> bool:
        """Count ``result``; True when the crashes among the last ``window`` runs are over ``rate`` (the
        window then starts again, so the canary runs at most once per ``window`` runs)."""
        crashed = result.status == "crashed"
        with self._lock:
            if crashed:
                self.last_error = result.error
            self.recent.append(crashed)
            if len(self.recent) < self.window or sum(self.recent) <= self.rate * self.window:
                return False
            self.recent.clear()
            return True

    def verdict(self, canary: RunResult) -> str | None:
        """Why the sandbox itself is failing, from the canary's result; None when the canary passed."""
        if canary.fraction_passed == 1.0:
            return None
        tests = "; ".join(f"{t.status}: {t.error}" for t in canary.tests if t.error) or "wrong answers"
        how = f"{canary.status}: {canary.error or tests}"
        return (
            f"more than {self.rate:.0%} of the last {self.window} programs' sandboxes crashed (the last: "
            f"{self.last_error}), and a program known to pass failed as well ({how}). "
            "The sandbox is failing, not the programs: check the host's free memory (an out-of-memory "
            "kill) and processes, the space and descriptors left (/tmp, ulimit -n), and that the sandbox's "
            "python and bwrap run (env.<name>.args.python, bwrap); the log above has each crash. Fix it, "
            "then resume (ckpt.resume=latest)"
        )
