"""What a sandbox is asked and what comes back: the tests (their inputs go in, their expected values never
do), each test's result, the verdict taken outside the sandbox (:func:`matches`), and the most a reply can
hold (:func:`reply_bound`, the bound the pool reads it with)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any


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
    __test__ = False  # not a pytest test class

    passed: bool
    # ok (ran to the end; passed says whether it was right), error, timeout, denied_syscall (SIGSYS)
    status: str
    time_s: float
    stdout: str = ""
    stderr: str = ""
    error: str = ""


@dataclass
class RunResult:
    tests: list[TestResult]
    wall_s: float
    # ok, timeout (the whole program), crashed (the sandbox ended without results), denied_syscall (a test's
    # process was killed by the seccomp filter: every test fails), over_limit (a reply longer than its tests
    # can produce: every test fails). Each is counted by the environment that scores with it (envs/code.py)
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
        return isinstance(reported.get("stdout"), str) and _lines(reported["stdout"]) == _lines(
            str(test.expected)
        )
    return _same(reported.get("value"), json.loads(json.dumps(test.expected)))


# JSON's worst case for text: a byte that is not UTF-8 decodes to U+FFFD, which json.dumps writes as 6 bytes
JSON_TEXT_GROWTH = 6
REPLY_SLACK = 1024  # per test: the field names, status, time and error


def reply_bound(lim: Any, tests: list[TestCase]) -> int:
    """The most bytes the runner's reply to ``tests`` can hold under ``lim``
    (:class:`~asyncrl.sandbox.Limits`; pure): per test, its stdout (an io test's whole output, the file-size
    limit; otherwise ``output_chars``) and stderr (``output_chars``) as JSON text, and its value
    (``value_bytes``, re-serialised: twice that covers a float's longer spelling), plus slack."""
    per_test = []
    for t in tests:
        out = lim.file_size_kb * 1024 if t.kind == "io" else lim.output_chars
        text = JSON_TEXT_GROWTH * (out + lim.output_chars)
        per_test.append(text + 2 * lim.value_bytes + REPLY_SLACK)
    return sum(per_test) + REPLY_SLACK
