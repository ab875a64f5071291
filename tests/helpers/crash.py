"""Crash an `asyncrl rl` run with SIGKILL and resume it: what tests/integration/test_crash_resume.py runs
once per process in CI and what tests/crash_matrix.py runs at random steps and moments before a resolve.

A trial: start the run, wait until the trainer has logged step ``after_step`` (plus ``delay_s``), SIGKILL
one process (``inference``, ``orchestrator``, ``trainer`` or the ``launcher`` itself), check that the
launcher names the dead process and its log and that no process of the run is left, then resume with
``ckpt.resume=latest``, check that the resumed run leaves no process either, and compare the result with a
straight run: learning metrics row for row, the final policy bit for bit.

"No process left" means every descendant of the launcher, found by the process tree while the run lives
(tests/helpers/processes.py): the sidecar's engine and multiprocessing's helpers carry no trace of the run in
their command lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from safetensors.numpy import load_file

from helpers.launch import start_asyncrl
from helpers.metrics import learning_metrics, read_jsonl
from helpers.processes import ProcessTree, describe

TARGETS = ("inference", "orchestrator", "trainer", "launcher")
_COMMANDS = {"serve": "inference", "orchestrate": "orchestrator", "train": "trainer"}


def run_processes(run: Path) -> dict[str, int]:
    """``{process name: pid}`` of the live asyncrl commands of the run in ``run`` (found by its config file),
    to pick one to kill. A process forked by one of them with the same command line (the CPU sidecar's
    engine) is not named: the one whose parent runs another command is. Not for "is anything left" (see
    :func:`left_behind`): processes started otherwise carry no config file."""
    config = str(run / "configs" / "config.yaml")
    commands: dict[int, tuple[str, int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = [
                a.decode(errors="replace") for a in (d / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            ]
            if len(argv) == 1:  # a forked child's title (setproctitle): one string, as psutil splits it
                argv = argv[0].split()
            parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if config in argv and "asyncrl" in argv and argv.index("asyncrl") + 1 < len(argv):
            command = argv[argv.index("asyncrl") + 1]
            commands[int(d.name)] = (_COMMANDS.get(command, command), parent)
    return {
        name: pid for pid, (name, parent) in commands.items() if commands.get(parent, ("", 0))[0] != name
    }


def trainer_step(run: Path) -> int:
    rows = read_jsonl_tolerant(run / "metrics" / "trainer.jsonl")
    return max((r["step"] for r in rows), default=-1)


def read_jsonl_tolerant(path: Path) -> list[dict]:
    try:
        return read_jsonl(path)
    except (FileNotFoundError, ValueError):  # not there yet, or a line being written
        return []


@dataclass
class Trial:
    target: str
    after_step: int
    delay_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    killed_at: int = -1  # the trainer's last logged step when the kill landed
    resumed_from: str = ""


def left_behind(tree: ProcessTree, grace_s: float = 30) -> list[str]:
    """The processes of ``tree`` that still run after up to ``grace_s`` (children of a killed launcher get
    SIGTERM through PDEATHSIG and need a moment), described; each is then killed by PID so the next trial
    starts clean."""
    deadline = time.monotonic() + grace_s
    while (left := tree.alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = describe(left)
    for p in left:
        try:
            p.kill()  # psutil refuses if the PID now belongs to another process
        except psutil.Error:
            pass
    return described


def run_watched(
    args: list[str], log: Path, timeout_s: float
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``asyncrl *args`` to its end (killed after ``timeout_s``), its output in ``log``: the completed
    process (its stdout and stderr both the log's text) and what of it is left behind."""
    proc = start_asyncrl(*args, log=log)
    tree = ProcessTree(proc.pid).watch()
    killed = ""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        tree.sample()
        proc.kill()
        proc.wait()
        killed = f"\n(killed after {timeout_s:.0f} s)"
    finally:
        tree.stop()
    text = log.read_text(errors="backslashreplace") + killed
    return subprocess.CompletedProcess(proc.args, proc.returncode, text, text), left_behind(tree)


def crash_and_resume(
    args: list[str], run: Path, straight: Path, trial: Trial, max_steps: int, timeout_s: float = 300
) -> Trial:
    """One trial (see the module docstring); ``args`` are the run's overrides without ``ckpt.resume``.
    Fills ``trial.problems`` (empty = passed)."""
    out = run.parent / f"{run.name}.launcher.log"
    launcher = start_asyncrl("rl", *args, log=out)
    tree = ProcessTree(launcher.pid).watch()
    try:
        deadline = time.monotonic() + timeout_s
        while trainer_step(run) < trial.after_step:
            if launcher.poll() is not None or time.monotonic() > deadline:
                trial.problems.append(
                    f"the run ended or stalled before step {trial.after_step}:\n{out.read_text()[-3000:]}"
                )
                return trial
            time.sleep(0.02)
        time.sleep(trial.delay_s)
        pids = run_processes(run)
        pid = launcher.pid if trial.target == "launcher" else pids.get(trial.target)
        trial.killed_at = trainer_step(run)
        if pid is None or launcher.poll() is not None:
            trial.problems.append(f"{trial.target} was not running at step {trial.killed_at} (run over?)")
            return trial
        tree.sample()  # the whole tree as the kill lands: what it orphans is known from here on
        os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        tree.stop()
    report = out.read_text()
    if trial.target != "launcher":
        if launcher.returncode != 1:
            trial.problems.append(f"launcher exit code {launcher.returncode}, expected 1")
        if f"{trial.target} died" not in report or str(run / "logs" / f"{trial.target}.log") not in report:
            trial.problems.append(
                f"the launcher did not name the dead {trial.target} and its log:\n{report[-2000:]}"
            )
    if left := left_behind(tree):
        trial.problems.append("processes left behind by the killed run:\n" + "\n".join(left))
    resumed, left = run_watched(
        ["rl", *args, "ckpt.resume=latest"], run.parent / f"{run.name}.resumed.log", timeout_s
    )
    if left:
        trial.problems.append("processes left behind by the resumed run:\n" + "\n".join(left))
    trial.resumed_from = next(
        (
            line.split("resuming from ")[1].split(";")[0]
            for line in resumed.stderr.splitlines()
            if "resuming from " in line
        ),
        "",
    )
    if resumed.returncode != 0:
        trial.problems.append(f"resume exited {resumed.returncode}:\n{resumed.stderr[-3000:]}")
        return trial
    compare_with_straight(run, straight, trial, max_steps)
    return trial


def compare_with_straight(run: Path, straight: Path, trial: Trial, max_steps: int) -> None:
    """Learning metrics row for row and the final policy bit for bit, into ``trial.problems``."""
    for process in ("orchestrator", "trainer"):
        a, b = (
            learning_metrics(run / "metrics" / f"{process}.jsonl"),
            learning_metrics(straight / "metrics" / f"{process}.jsonl"),
        )
        if a != b:
            first = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
            )
            trial.problems.append(
                f"{process} metrics differ from the straight run's ({len(a)} vs {len(b)} rows, "
                f"first difference at row {first})"
            )
    for name in (f"weights/step_{max_steps}", "model"):
        a, b = (
            load_file(str(run / name / "model.safetensors")),
            load_file(str(straight / name / "model.safetensors")),
        )
        if a.keys() != b.keys() or not all((a[k] == b[k]).all() for k in a):
            trial.problems.append(f"{name} is not bit-identical to the straight run's")
