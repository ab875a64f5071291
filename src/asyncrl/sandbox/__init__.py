"""Untrusted code, run in isolation: a pool of pre-warmed bubblewrap sandboxes (``pool``), how they are
isolated (``isolation``) and the program that runs inside each (``runner``, standard library only)."""

from asyncrl.sandbox.isolation import SandboxUnavailable
from asyncrl.sandbox.pool import Limits, Sandbox
from asyncrl.sandbox.verdict import RunResult, TestCase, TestResult, matches

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxUnavailable", "TestCase", "TestResult", "matches"]
