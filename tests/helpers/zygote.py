"""The suite's ``asyncrl ...`` commands as forks of one process per test worker that imported torch and
transformers.

A fresh interpreter spends ~5-7 s of CPU importing torch, transformers and asyncrl before a command does
anything (``python -c "import torch, transformers; from transformers import AutoModelForCausalLM"``: 6.6 s on
2 cores), and the suite starts about a hundred such commands: a third of test_rl.py's CPU time. :func:`run`
hands a command to a *zygote* (this file run as a script: it imports what the launcher preloads,
:func:`asyncrl.utils.forked.preload`, then waits for commands on its stdin) which forks a child that becomes
what ``python -m asyncrl ARGS`` would be: its own session, the test's working directory first on
``sys.path``, its environment, its output in files, default signal handlers, the exit code passed back. The
launcher's own children start the same way (:mod:`asyncrl.utils.forked`).

Forking is only the same as a fresh start when torch was imported under the variables the command would
import it under, so a command starts fresh (:func:`run` returns ``None``) when the test gives it cores or an
environment of its own that differs in more than ``PYTHONPATH`` (the golden tests' outer environments must
reach a fresh interpreter), when this process's import-time variables have changed since the zygote started,
or when its config's numerics mode sets other kernel variables (``numerics=fast``: the child sees that before
doing anything and exits with :data:`FRESH`). A ``PYTHONPATH`` of its own (a user's plugins, agents or tasks)
only changes where imports look: the child takes the ``sys.path`` a fresh interpreter would have
(``zygote_process._fresh_path``), unless a directory it adds holds a module the zygote imported from
elsewhere.
``ASYNCRL_TEST_FORK=0`` starts every command fresh.

Commands a test does not start itself (DVC's stages, a test's ``subprocess.run(["asyncrl", ...])``) reach the
same zygote through :func:`shim_env`: an ``asyncrl`` executable for the front of ``PATH`` that passes its
arguments, working directory, environment and standard streams (the descriptors themselves) over the zygote's
socket and exits with the child's code; where the zygote is gone or asks for a fresh start, it becomes
``python -m asyncrl`` itself. The fork servers that ``multiprocessing`` starts for a forked command (an
orchestrator's env workers) come from the zygote too, through its ``python``
(``zygote_process.python_shim``), as do those of a test's own pools within :func:`fork_servers`. The zygote's
own process, and the shims, are :mod:`helpers.zygote_process`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from helpers.zygote_process import FRESH, SOCKET_VAR, _same_imports, _startup_env

PROCESS = Path(__file__).with_name("zygote_process.py")  # the zygote's script


def _without_path(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != "PYTHONPATH"}


class Zygote:
    """The client side: the zygote process, the commands it runs and their exit codes. ``env``: the whole
    environment it starts under, and the one its commands must have but for ``PYTHONPATH`` (default: this
    process's, as it is at each command: pytest changes ``PYTEST_CURRENT_TEST`` at every test); ``cpus``:
    the cores it and its commands may use (default: this process's)."""

    def __init__(self, env: dict[str, str] | None = None, cpus: set[int] | None = None) -> None:
        self._env = None if env is None else dict(env)
        self.env = _startup_env(self.base)
        self.dir = tempfile.mkdtemp(prefix="asyncrl-zygote-")  # its socket and the shim
        atexit.register(shutil.rmtree, self.dir, True)
        self.socket = os.path.join(self.dir, "socket")
        _write_shims(self.dir, self.socket)
        self.proc = subprocess.Popen(
            [sys.executable, str(PROCESS), self.socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**self.base, "PYTHONUNBUFFERED": "1"},
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.lock = threading.Lock()  # one thread at a time talks to the zygote
        self.ended: dict[int, int] = {}  # exit codes read before they were asked for
        self._pending = b""  # what the zygote wrote past its last line read

    @property
    def base(self) -> dict[str, str]:
        """The environment its commands must have but for ``PYTHONPATH``."""
        return dict(os.environ if self._env is None else self._env)

    def run(
        self, args: tuple[str, ...], timeout: float, cwd: Path | None, env: dict | None = None
    ) -> subprocess.CompletedProcess | None:
        """``asyncrl *args`` in a fork, or ``None`` where it must start fresh. ``env``: its whole
        environment, forked only where it is the zygote's but for ``PYTHONPATH``."""
        env = dict(self.base if env is None else env)
        if _without_path(env) != _without_path(self.base):
            return None
        if self.proc.poll() is not None or _startup_env(env) != self.env:
            return None
        # another thread's command is running: this one starts fresh
        if not self.lock.acquire(blocking=False):
            return None
        try:
            with tempfile.TemporaryDirectory(prefix="asyncrl-fork-") as tmp:
                out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
                pid = self._request(args, cwd, out, err, env)
                code = self._code(pid, timeout)
                if code is None:  # a hang guard, as subprocess.run's: the child's whole session goes
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    self._code(pid, None)
                text = {p: p.read_text(errors="backslashreplace") if p.exists() else "" for p in (out, err)}
        finally:
            self.lock.release()
        if code == FRESH:
            return None
        cmd = [sys.executable, "-m", "asyncrl", *args]
        if code is None:
            raise subprocess.TimeoutExpired(cmd, timeout, output=text[out], stderr=text[err])
        return subprocess.CompletedProcess(cmd, code, text[out], text[err])

    def start(
        self, args: tuple[str, ...], cwd: Path | None, log: Path, env: dict | None = None
    ) -> Forked | None:
        """``asyncrl *args`` forked in the background, its stdout and stderr into ``log`` (appended), ``env``
        added to the zygote's environment (``None`` removes a variable); ``None`` where it must start
        fresh. The zygote serves this worker's other commands meanwhile."""
        merged = {k: v for k, v in {**self.base, **(env or {})}.items() if v is not None}
        if self.proc.poll() is not None or _startup_env(merged) != self.env:
            return None
        if not _same_imports(list(args), self.env) or not self.lock.acquire(blocking=False):
            return None
        try:
            pid = self._request(args, cwd, log, log, merged)
        finally:
            self.lock.release()
        return Forked(self, pid, [sys.executable, "-m", "asyncrl", *args])

    def preload(self, modules: list[str]) -> None:
        """Have the zygote import ``modules`` as well: for a test file whose commands all import a heavy
        module (verifiers: ~6 s of CPU), which they then find imported. A fresh command imports them after
        what the zygote preloads too, so a fork still starts as a fresh one would."""
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write(json.dumps({"import": modules}) + "\n")
            self.proc.stdin.flush()
            answer = self._reply()
        assert answer.get("imported") == modules, answer

    def close(self, timeout: float = 60) -> int:
        """End the zygote as a worker's exit does (its end of the pipe closes): the commands it still runs
        go with it. Its exit code."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout)

    def _request(self, args: tuple[str, ...], cwd: Path | None, out: Path, err: Path, env: dict) -> int:
        """Hand the zygote a command; the pid of its child."""
        request = {
            "args": list(args),
            "cwd": str(cwd or os.getcwd()),
            "stdout": str(out),
            "stderr": str(err),
            "env": {**env, "PYTHONUNBUFFERED": "1"},
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply()["pid"]

    def _reply(self) -> dict:
        """The zygote's answer to a request; the exit codes of children that end meanwhile are kept."""
        while "code" in (answer := json.loads(self._line(None) or "{}")):
            self.ended[answer["pid"]] = answer["code"]
        return answer

    def _code(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of child ``pid`` (the zygote answers every child's as it ends); ``None`` past
        ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.ended:
            line = self._line(None if deadline is None else max(deadline - time.monotonic(), 0))
            if line is None:
                return None
            answer = json.loads(line)
            self.ended[answer["pid"]] = answer["code"]
        return self.ended.pop(pid)

    def shim_env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with the shim's ``asyncrl`` (``zygote_process.shim``) first on ``PATH`` and the way to
        this zygote."""
        return {**env, SOCKET_VAR: self.socket, "PATH": f"{self.dir}{os.pathsep}{env.get('PATH', '')}"}

    def _line(self, timeout: float | None) -> str | None:
        """The zygote's next line, read from its pipe's descriptor (a buffered reader could hold a line that
        select() then waits for in vain); ``None`` past ``timeout``."""
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            if (
                deadline is not None
                and not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]
            ):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(
                    f"the suite's zygote (tests/helpers/zygote.py) died, exit {self.proc.wait()}"
                )
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()


def _write_shims(directory: str, socket_path: str) -> None:
    """The zygote's ``asyncrl`` and ``python`` executables (``zygote_process.shim``, ``python_shim``)."""
    tests = Path(__file__).resolve().parents[1]
    for name, call in (("asyncrl", "shim()"), ("python", f"python_shim({socket_path!r})")):
        path = Path(directory, name)
        text = f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(tests)!r})\n"
        path.write_text(f"{text}from helpers.zygote_process import {call.partition('(')[0]}\n{call}\n")
        path.chmod(0o755)


class Forked:
    """The part of :class:`subprocess.Popen` the tests and :func:`asyncrl.utils.children.stop` use, for a
    command of :meth:`Zygote.start`: the zygote is its parent and answers its exit code (negative for a
    signal, as ``Popen``'s) when it ends."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._ended(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _ended(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            with self.zygote.lock:
                self.returncode = self.zygote._code(self.pid, timeout)
            assert self.returncode != FRESH, (
                f"{self.args} asked for a fresh start after the check said it need not"
            )
        return self.returncode


_zygote: Zygote | None = None


def _forking() -> bool:
    """Whether commands fork at all (``ASYNCRL_TEST_FORK=0`` starts every one fresh)."""
    return os.environ.get("ASYNCRL_TEST_FORK", "1") != "0"


def _started() -> Zygote | None:
    """This worker's zygote, started at the first call; ``None`` under ``ASYNCRL_TEST_FORK=0``."""
    global _zygote
    if not _forking():
        return None
    if _zygote is None:
        _zygote = Zygote()
    return _zygote


def run(
    args: tuple[str, ...], timeout: float, cwd: Path | None, env: dict | None = None
) -> subprocess.CompletedProcess | None:
    """``asyncrl *args`` forked from this worker's zygote (:meth:`Zygote.run`), or ``None``: start it
    fresh."""
    zygote = _started()
    return zygote.run(args, timeout, cwd, env) if zygote is not None else None


def start(args: tuple[str, ...], cwd: Path | None, log: Path, env: dict | None = None) -> Forked | None:
    """``asyncrl *args`` forked from this worker's zygote in the background (:meth:`Zygote.start`), or
    ``None``."""
    zygote = _started()
    return zygote.start(args, cwd, log, env) if zygote is not None else None


@contextlib.contextmanager
def own(env: dict[str, str], cpus: set[int] | None = None) -> Iterator[Zygote | None]:
    """A zygote of the block's own, started under ``env`` (the whole environment, as the commands will have
    it: their numerics applied, :func:`asyncrl.numerics.apply`, since torch is imported before they run) on
    ``cpus``: for several commands under an environment other than the worker's, which would each start
    fresh otherwise. Ended with the block; ``None`` under ``ASYNCRL_TEST_FORK=0``."""
    if not _forking():
        yield None
        return
    zygote = Zygote(env, cpus)
    try:
        yield zygote
    finally:
        zygote.close()


def preload(*modules: str) -> None:
    """This worker's zygote imports ``modules`` as well (:meth:`Zygote.preload`); nothing under
    ``ASYNCRL_TEST_FORK=0``."""
    zygote = _started()
    if zygote is not None:
        zygote.preload(list(modules))


@contextlib.contextmanager
def fork_servers() -> Iterator[None]:
    """Within the block, the fork servers this process's :mod:`multiprocessing` starts (an in-process
    pool's env workers) fork from this worker's zygote where it can take them
    (``zygote_process.python_shim``), as a forked command's do; nothing changes under
    ``ASYNCRL_TEST_FORK=0``."""
    import multiprocessing.spawn

    zygote, before = _started(), multiprocessing.spawn.get_executable()
    if zygote is not None:
        multiprocessing.set_executable(os.path.join(zygote.dir, "python"))
    try:
        yield
    finally:
        multiprocessing.set_executable(before)


def shim_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the shim's ``asyncrl`` first on ``PATH`` and the way to this worker's zygote (``env``
    unchanged under ``ASYNCRL_TEST_FORK=0``)."""
    zygote = _started()
    return zygote.shim_env(env) if zygote is not None else env
