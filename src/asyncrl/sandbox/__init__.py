"""Untrusted code, run in isolation: a pool of pre-warmed bubblewrap sandboxes (``pool``), how they are
isolated (``isolation``) and the program that runs inside each (``runner``, standard library only); and
untrusted agent programs, one sandbox per episode whose one way out is its rollout's endpoint (``agents``,
``relay``)."""

from asyncrl.sandbox.isolation import SandboxUnavailable
from asyncrl.sandbox.pool import Limits, Sandbox
from asyncrl.sandbox.verdict import RunResult, TestCase, TestResult, matches

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxUnavailable", "TestCase", "TestResult", "matches"]
