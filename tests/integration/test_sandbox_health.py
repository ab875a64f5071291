"""Failures named, not mistaken for a bad policy: a sandbox that starts and then crashes every job is told
from programs that crash by a canary, and stops the run with the canary's verdict; the causes show in the
metrics.

The broken sandbox here is a real misconfiguration: its interpreter runs under ``ulimit -n 6``, enough to
start the runner and say ``ready``, too few descriptors for any test (the runner dies with EMFILE on each
job)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.sandbox import RunResult, Sandbox, SandboxUnavailable, TestCase, TestResult
from asyncrl.sandbox.health import CrashWatch
from helpers.launch import MICRO_MODEL, asyncrl
from helpers.metrics import read_jsonl

VERDICT = "a program known to pass failed as well"


@pytest.fixture
def broken_python() -> Iterator[str]:
    """An interpreter for the sandbox that starts and then fails every job. Outside /tmp (the sandbox's own
    /tmp hides the host's) and readable by the sandbox's user."""
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    assert python, "no python3 in /usr/bin or /usr/local/bin"
    root = Path(tempfile.mkdtemp(prefix="asyncrl-broken-", dir="/var/tmp"))
    try:
        (root / "bin").mkdir()
        wrapper = root / "bin" / "python3"
        wrapper.write_text(f'#!/bin/sh\nulimit -n 6\nexec {python} "$@"\n')
        for p in (root, root / "bin", wrapper):
            p.chmod(0o755)
        yield str(wrapper)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def result(status: str) -> RunResult:
    return RunResult([], 0.0, status, "the sandbox ended without results" if status == "crashed" else "")


def test_the_watch_calls_the_canary_past_the_crash_rate_once_per_window():
    watch = CrashWatch(rate=0.5, window=4)
    # 2 of 4: not over
    assert [watch.record(result(s)) for s in ["ok", "crashed", "ok", "crashed"]] == [False] * 4
    assert watch.record(result("crashed")) is True  # 3 of the last 4
    assert [watch.record(result("crashed")) for _ in range(4)] == [False, False, False, True]  # a new window
    assert watch.verdict(RunResult([TestResult(True, "ok", 0.0)], 0.0)) is None
    failed = RunResult([TestResult(False, "error", 0.0, error="boom")], 0.0, "crashed", "no results")
    assert VERDICT in watch.verdict(failed) and "crashed: no results" in watch.verdict(failed)


def test_a_sandbox_that_crashes_every_job_is_stopped_by_the_canary(broken_python):
    call = [TestCase("call", 1, fn="f")]
    with Sandbox(workers=1, python=broken_python, crash_rate=0.5, crash_window=3) as sandbox:
        for _ in range(2):
            r = sandbox.run("def f():\n    return 1\n", call)
            assert r.status == "crashed" and "Too many open files" in r.error, r
        with pytest.raises(SandboxUnavailable, match=VERDICT) as e:
            sandbox.run("def f():\n    return 1\n", call)
        assert "ulimit -n" in str(e.value)  # what to check
        with pytest.raises(SandboxUnavailable, match=VERDICT):  # and so for every later program
            sandbox.run("def f():\n    return 1\n", call)


@pytest.mark.slow
def test_a_run_whose_sandbox_crashes_every_job_stops_with_the_canarys_verdict(tmp_path, broken_python):
    model = [o for o in MICRO_MODEL if "charset" not in o] + ["model.init.max_position_embeddings=512"]
    data = [
        f"data_dir={tmp_path / 'data'}",
        "env=code",
        "env.code.args.num_train=40",
        "env.code.args.num_eval=4",
    ]
    common = [*data, "seq_len=512", f"model.name={tmp_path / 'model'}"]
    asyncrl("prepare", *common, *model, check=True)
    run = tmp_path / "rl"
    sandbox = [
        f"env.code.args.python={broken_python}",
        "env.code.args.workers=1",
        "env.code.args.crash_window=8",
    ]
    steps = [
        "max_steps=20",
        "orchestrator.max_tokens=8",
        "orchestrator.prompts_per_step=2",
        "orchestrator.group_size=2",
    ]
    proc = asyncrl("rl", *common, f"run_dir={run}", *steps, *sandbox, "launcher.progress=false", timeout=400)
    log = (run / "logs" / "orchestrator.log").read_text()
    assert proc.returncode != 0 and VERDICT in log, proc.stderr[-3000:]
    assert "orchestrator" in proc.stderr  # the launcher names the process that stopped, and its log
    metrics = read_jsonl(run / "metrics" / "orchestrator.jsonl")
    assert len(metrics) < 8, "it stops within a few steps"
    assert all(
        m["rollout/code/sandbox_crashed_mean"] == 1.0
        for m in metrics
        if "rollout/code/sandbox_crashed_mean" in m
    )
    assert any("rollout/code/sandbox_crashed_mean" in m for m in metrics), metrics


@pytest.mark.parametrize(
    "release, cgroup, words",
    [
        ("4.18.0-513.el8.x86_64", False, "Linux 4.18 counts every sandbox's processes"),
        ("5.10.0-28-amd64", False, "per-user-namespace accounting came in Linux 5.14"),
        ("5.10.0-28-amd64", True, None),  # pids.max holds the bound
        ("5.14.0-362.el9.x86_64", False, None),
        ("6.1.0-13-amd64", False, None),
        ("4.18.0-513.el8.x86_64", True, "needs pidfd_open"),
    ],
)
def test_the_pool_refuses_a_kernel_that_cannot_hold_its_bounds(release, cgroup, words):
    from asyncrl.sandbox.bounds import kernel_problem

    problem = kernel_problem(release, cgroup)
    assert (problem is None) if words is None else (words in problem), problem


def test_a_copy_of_bwrap_left_by_a_killed_process_is_removed_at_the_next_start(tmp_path):
    """A process killed by a signal skips its atexit: the copy it made of bwrap stays, world-readable, until
    a later pool starts and removes every copy whose process is gone."""
    import subprocess
    import sys

    from asyncrl.sandbox.isolation import STAGE_PREFIX
    from asyncrl.utils.tempdirs import remove_stale

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f"{STAGE_PREFIX}{dead.stdout.strip()}-abc"
    live = tmp_path / f"{STAGE_PREFIX}{os.getpid()}-def"
    for d in (stale, live):
        (d / "bin").mkdir(parents=True)
    assert remove_stale(STAGE_PREFIX, str(tmp_path)) == [stale]
    assert not stale.exists() and live.exists()
