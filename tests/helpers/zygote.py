"""The suite's ``asyncrl ...`` commands as forks of one process per test worker that imported torch and transformers.

A fresh interpreter spends ~5-7 s of CPU importing torch, transformers and asyncrl before a command does anything
(``python -c "import torch, transformers; from transformers import AutoModelForCausalLM"``: 6.6 s on 2 cores), and
the suite starts about a hundred such commands: a third of test_rl.py's CPU time. :func:`run` hands a command to a
*zygote* (this file run as a script: it imports what the launcher preloads, :func:`asyncrl.utils.forked.preload`,
then waits for commands on its stdin) which forks a child that becomes what ``python -m asyncrl ARGS`` would be:
its own session, the test's working directory first on ``sys.path``, its environment, its output in files, default
signal handlers, the exit code passed back. The launcher's own children start the same way
(:mod:`asyncrl.utils.forked`).

Forking is only the same as a fresh start when torch was imported under the variables the command would import it
under, so a command starts fresh (:func:`run` returns ``None``) when the test gives it an environment or cores of its
own (the golden tests' outer environments must reach a fresh interpreter), when this process's import-time
variables have changed since the zygote started, or when its config's numerics mode sets other kernel variables
(``numerics=fast``: the child sees that before doing anything and exits with :data:`FRESH`).
``ASYNCRL_TEST_FORK=0`` starts every command fresh.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

FRESH = 86  # the child's exit code for "start me in a fresh interpreter instead"
# what decides how a fresh interpreter starts, besides the kernel variables numerics reads at import
STARTUP = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONWARNINGS", "PYTHONHASHSEED")


def _startup_env(env) -> dict[str, str | None]:
    from asyncrl.numerics import READ_AT_IMPORT

    return {k: env.get(k) for k in (*READ_AT_IMPORT, *STARTUP)}


class Zygote:
    """The client side: the zygote process and the one command it runs at a time."""

    def __init__(self) -> None:
        self.env = _startup_env(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lock = threading.Lock()
        self._pending = b""  # what the zygote wrote past its last line read

    def run(self, args: tuple[str, ...], timeout: float, cwd: Path | None) -> subprocess.CompletedProcess | None:
        """``asyncrl *args`` in a fork, or ``None`` where it must start fresh."""
        if self.proc.poll() is not None or _startup_env(os.environ) != self.env:
            return None
        if not self.lock.acquire(blocking=False):  # another thread's command is running: this one starts fresh
            return None
        try:
            with tempfile.TemporaryDirectory(prefix="asyncrl-fork-") as tmp:
                out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
                request = {
                    "args": list(args),
                    "cwd": str(cwd or os.getcwd()),
                    "stdout": str(out),
                    "stderr": str(err),
                    "env": {**os.environ, "PYTHONUNBUFFERED": "1"},
                }
                code = self._exchange(request, timeout)
                text = {p: p.read_text(errors="backslashreplace") if p.exists() else "" for p in (out, err)}
        finally:
            self.lock.release()
        if code == FRESH:
            return None
        cmd = [sys.executable, "-m", "asyncrl", *args]
        if isinstance(code, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(cmd, timeout, output=text[out], stderr=text[err])
        return subprocess.CompletedProcess(cmd, code, text[out], text[err])

    def _exchange(self, request: dict, timeout: float) -> int | subprocess.TimeoutExpired:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self._line(None) or "{}")["pid"]
        answer = self._line(timeout)
        if answer is None:  # a hang guard, as subprocess.run's: the child's whole session goes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self._line(None)
            return subprocess.TimeoutExpired(request["args"], timeout)
        return json.loads(answer)["code"]

    def _line(self, timeout: float | None) -> str | None:
        """The zygote's next line, read from its pipe's descriptor (a buffered reader could hold a line that
        select() then waits for in vain); ``None`` past ``timeout``."""
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            if deadline is not None and not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"the suite's zygote (tests/helpers/zygote.py) died, exit {self.proc.wait()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()


_zygote: Zygote | None = None


def run(args: tuple[str, ...], timeout: float, cwd: Path | None) -> subprocess.CompletedProcess | None:
    """``asyncrl *args`` forked from this worker's zygote (started at the first call), or ``None``: start it fresh."""
    global _zygote
    if os.environ.get("ASYNCRL_TEST_FORK", "1") == "0":
        return None
    if _zygote is None:
        _zygote = Zygote()
    return _zygote.run(args, timeout, cwd)


# the zygote's side


def _same_imports(args: list[str], at_start: dict[str, str | None]) -> bool:
    """Whether the command would import torch under the kernel variables this process imported it under."""
    from asyncrl import cli, numerics
    from asyncrl.config.compose import load_config

    if not args or args[0] not in cli.COMMANDS or args[0] in cli.OWN_OPTIONS:
        return True
    try:
        parsed = cli.parse(args)
        cfg = load_config(parsed["overrides"], parsed["config_file"], parsed["config_dirs"])
    except BaseException:  # noqa: BLE001 (the command reports its own errors, the same in a fork)
        return True
    env = dict(os.environ)
    numerics.apply(cfg.numerics, numerics.process_threads(cfg, parsed["command"]), env)
    return all(env.get(k) == v for k, v in at_start.items() if k in numerics.READ_AT_IMPORT)


def _child(request: dict, at_start: dict[str, str | None]) -> None:
    """Become ``python -m asyncrl ARGS`` started in ``request["cwd"]`` with ``request["env"]``; never returns."""
    import setproctitle

    from asyncrl.utils import forked

    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # where `python -m` looks first
        forked._become_fresh(Path(request["stdout"]), request["env"])  # stdout and stderr, both to stdout's file
        fd = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True, errors="backslashreplace"
        )
        setproctitle.setproctitle(" ".join([sys.executable, "-m", "asyncrl", *request["args"]]))
        code = forked._run_module("asyncrl", request["args"]) if _same_imports(request["args"], at_start) else FRESH
    except BaseException:  # noqa: BLE001 (the child must never return into the zygote's loop)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def serve() -> None:
    """Import what the commands import, then fork one child per line of stdin, answering its pid and exit code;
    ends at the end of stdin, when the test worker exits (or dies: its end of the pipe closes with it)."""
    from asyncrl.utils import forked

    at_start = _startup_env(os.environ)
    forked.preload()
    import asyncrl.cli  # noqa: F401
    import asyncrl.config.compose  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, at_start)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
