"""Child processes with their logs in files, that die with their parent and stop in order."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from asyncrl.utils import forked
from asyncrl.utils.process import ProcessFailed

log = logging.getLogger("asyncrl.launcher")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child after the fork, before its command (or exec) starts
    os.setsid()  # own process group: Ctrl-C reaches the launcher, which stops children in order
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: children outlive a killed launcher, but a clean stop still works
        pass


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | forked.ForkedChild
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: Mapping[str, str | None] | None = None
    restarts: int = 0
    fork: bool = False

    def poll(self) -> int | None:
        return self.popen.poll()

    def restart(self) -> None:
        """Start the same command again (same port, same log, appended)."""
        self.popen = spawn(self.name, self.argv, self.log_path, self.env, fork=self.fork).popen
        self.restarts += 1


def asyncrl_argv(command: str, config_file: Path, *overrides: str, python: str = "") -> list[str]:
    """``asyncrl <command>`` with a resolved config file, run by ``python`` (``''``: this process's
    interpreter)."""
    return [
        python or sys.executable,
        "-m",
        "asyncrl",
        command,
        "--config-file",
        str(config_file),
        *overrides,
    ]


def spawn(
    name: str,
    argv: list[str],
    log_path: Path,
    env: Mapping[str, str | None] | None = None,
    fork: bool = False,
) -> Proc:
    """Start ``argv`` with its output in ``log_path``; ``env`` is added to this process's environment (a
    ``None`` value removes that variable). ``fork``: start a ``python -m`` command of this interpreter as a
    fork of this process when it preloaded its libraries (:mod:`asyncrl.utils.forked`); a fresh interpreter
    otherwise."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    merged = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full = {k: v for k, v in merged.items() if v is not None}
    if fork and forked.can_fork(argv):
        child = forked.fork_module(argv, log_path, full, _die_with_parent)
        return Proc(name, child, log_path, list(argv), env, fork=True)
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
            env=full,
        )
    return Proc(name, popen, log_path, list(argv), env, fork=fork)


def stop(procs: list[Proc], timeout_s: float) -> None:
    """SIGTERM each live process group, wait up to ``timeout_s``, then SIGKILL what is left."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for p in live:
        try:
            p.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.popen.wait()


def wait_healthy(proc: Proc, url: str, timeout_s: float) -> None:
    """Poll ``url/health`` until it answers 200, saying every 10 s that it waits; :class:`ProcessFailed`
    (naming the process and its log) if the process dies first or ``timeout_s`` passes."""
    start = said = time.monotonic()
    # one client for every poll: each new client loads the CA bundle (~50 ms of CPU), which at 10 polls a
    # second costs more than the wait (`python -m cProfile -m asyncrl rl ...`, load_verify_locations)
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() - start < timeout_s:
            if proc.poll() is not None:
                raise ProcessFailed(
                    f"{proc.name} exited with code {proc.poll()} before it was healthy; its log: "
                    f"{proc.log_path}\n{tail(proc.log_path)}"
                )
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - said >= 10:
                said = time.monotonic()
                waited = f"{said - start:.0f} s; log: {proc.log_path}"
                log.info(f"waiting for {proc.name} at {url} to load its model ({waited})")
            time.sleep(0.1)
    raise ProcessFailed(
        f"{proc.name} not healthy at {url} after inference.startup_timeout_s={timeout_s:.0f}; "
        f"its log: {proc.log_path}\n"
        f"{tail(proc.log_path)}"
    )


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])
