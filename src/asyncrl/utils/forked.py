"""Start asyncrl's CPU processes as forks of the launcher (or an eval) that imported torch and transformers.

A fresh interpreter spends most of a short CPU run importing: the trainer ~10 s of CPU, the built-in sidecar
~9 s, against ~2 s for three steps of the micro model
(`py-spy record --subprocesses -f raw -- python -m asyncrl rl ...` on 2 cores: imports 30 of 44 s of
samples). The launcher imports the heavy libraries once (:func:`preload`, after
:func:`asyncrl.numerics.apply` set what torch reads at import) and forks each child from there: the child
then runs ``asyncrl <command>`` as ``python -m asyncrl`` would, in its own session, with its own environment,
output, signals and exit handlers.

Forking is safe only where the parent holds no lock another thread might be holding and has started no OpenMP
pool or CUDA context: the launcher never runs a torch op, and :func:`can_fork` refuses once it has a second
thread (which could hold such a lock at the fork; that start gets a fresh interpreter instead). Anything
else, another interpreter or vLLM, starts a fresh interpreter as before (:func:`asyncrl.utils.children.spawn`
decides).
"""

from __future__ import annotations

import atexit
import importlib
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import setproctitle

if TYPE_CHECKING:
    from asyncrl.config import Config

# what the trainer and the built-in sidecar import before their first step: most of their start-up
PRELOAD = ("torch", "transformers", "lightning_fabric", "asyncrl.models.hf")
_preloaded = False


def preload() -> None:
    """Import :data:`PRELOAD` in this process (call after :func:`asyncrl.numerics.apply`)."""
    global _preloaded
    for name in PRELOAD:
        importlib.import_module(name)
    _preloaded = True


def forks(cfg: Config) -> dict[str, bool]:
    """Which processes start as forks of the process that starts them (the launcher; `asyncrl eval` for its
    sidecar) once it preloaded torch and transformers: those on the CPU, with this interpreter; vLLM and CUDA
    processes start fresh."""
    own = cfg.launcher.preload
    return {
        "inference": own and cfg.inference.backend == "hf" and not cfg.launcher.inference_python,
        "trainer": own and cfg.trainer.fabric.accelerator == "cpu" and not cfg.launcher.trainer_python,
        "orchestrator": own,
    }


def can_fork(argv: list[str]) -> bool:
    """Whether ``argv`` (``[python, -m, module, ...]`` with this interpreter) can start as a fork of this
    process."""
    own = len(argv) >= 3 and argv[:2] == [sys.executable, "-m"]
    return _preloaded and own and threading.active_count() == 1


class ForkedChild:
    """The part of :class:`subprocess.Popen` the launcher uses, for a child made by :func:`fork_module`."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code


def fork_module(
    argv: list[str], log_path: Path, env: dict[str, str], setup: Callable[[], None]
) -> ForkedChild:
    """Run ``argv`` (``[python, -m, module, ...]``) in a fork of this process with ``env`` as its whole
    environment and its output in ``log_path``; ``setup`` runs first in the child (its session and death
    signal)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        return ForkedChild(pid, argv)
    code = 1
    try:
        setup()
        # `ps`, `top` and a test's search by command line see the child's command, not the launcher's
        setproctitle.setproctitle(" ".join(argv))
        _become_fresh(log_streams(log_path), env)
        code = _run_module(argv[2], argv[3:])
    except BaseException:  # noqa: BLE001 (the child must never return into the launcher's code)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def log_streams(log_path: Path) -> tuple[int, int, int]:
    """Descriptors for a child's standard streams: stdin from /dev/null, stdout and stderr appended to
    ``log_path``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    return os.open(os.devnull, os.O_RDONLY), fd, fd


def _become_fresh(streams: tuple[int, int, int], env: dict[str, str]) -> None:
    """What a fresh interpreter would start with: ``streams`` (descriptors, closed here) as stdin, stdout and
    stderr, the environment, default signal handlers, no exit handlers or log handlers of the launcher's."""
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    for fd in set(streams) - {0, 1, 2}:
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True, errors="backslashreplace"
    )
    os.environ.clear()
    os.environ.update(env)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    atexit._clear()
    if (mp_util := sys.modules.get("multiprocessing.util")) is not None:
        atexit.register(mp_util._exit_function)  # registered once, at its import, in the launcher
        sys.modules["multiprocessing.process"]._children.clear()
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger):
            for handler in list(logger.handlers):
                logger.removeHandler(handler)


def _run_module(module: str, args: list[str]) -> int:
    """``python -m module *args`` in this process: ``sys.argv`` as it would be, the exit code, exit
    handlers."""
    sys.argv = [module, *args]
    code: int = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code
