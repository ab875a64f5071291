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
(:func:`_fresh_path`), unless a directory it adds holds a module the zygote imported from elsewhere.
``ASYNCRL_TEST_FORK=0`` starts every command fresh.

Commands a test does not start itself (DVC's stages, a test's ``subprocess.run(["asyncrl", ...])``) reach the
same zygote through :func:`shim_dir`: an ``asyncrl`` executable for the front of ``PATH`` that passes its
arguments, working directory, environment and standard streams (the descriptors themselves) over the zygote's
socket and exits with the child's code; where the zygote is gone or asks for a fresh start, it becomes
``python -m asyncrl`` itself. The fork servers that ``multiprocessing`` starts for a forked command (an
orchestrator's env workers) come from the zygote too, through its ``python`` (:func:`python_shim`), as do
those of a test's own pools within :func:`fork_servers`.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import fcntl
import importlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path

FRESH = 86  # the child's exit code for "start me in a fresh interpreter instead"
SOCKET_VAR = "ASYNCRL_TEST_ZYGOTE"  # the shim's way to its worker's zygote
# what decides how a fresh interpreter starts, besides the kernel variables numerics reads at import and
# PYTHONPATH (:func:`_fresh_path` gives a fork the path a fresh start would have)
STARTUP = (
    "PYTHONHOME",
    "PYTHONSAFEPATH",
    "PYTHONNOUSERSITE",
    "PYTHONWARNINGS",
    "PYTHONHASHSEED",
)


def _without_path(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != "PYTHONPATH"}


def _startup_env(env) -> dict[str, str | None]:
    from asyncrl.numerics import READ_AT_IMPORT

    return {k: env.get(k) for k in (*READ_AT_IMPORT, *STARTUP)}


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
            [sys.executable, __file__, self.socket],
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
        """``env`` with the shim's ``asyncrl`` (:func:`shim`) first on ``PATH`` and the way to this
        zygote."""
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
    """The zygote's ``asyncrl`` (:func:`shim`) and ``python`` (:func:`python_shim`) executables."""
    tests = Path(__file__).resolve().parents[1]
    for name, call in (("asyncrl", "shim()"), ("python", f"python_shim({socket_path!r})")):
        path = Path(directory, name)
        path.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(tests)!r})\n"
                        f"from helpers.zygote import {call.partition('(')[0]}\n{call}\n")  # fmt: skip
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
    pool's env workers) fork from this worker's zygote where it can take them (:func:`python_shim`), as a
    forked command's do; nothing changes under ``ASYNCRL_TEST_FORK=0``."""
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


def _kill_session(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def shim() -> None:
    """The ``asyncrl`` of :func:`shim_env`: this command forked from the zygote, its exit code this
    process's; a signal that stops this process stops the command's session too. Fresh where the zygote
    cannot take it."""
    args = sys.argv[1:]
    request = {"args": args, "cwd": os.getcwd(), "env": {**os.environ, "PYTHONUNBUFFERED": "1"}}
    _forward(request, [], os.environ.get(SOCKET_VAR, ""), [sys.executable, "-m", "asyncrl", *args])


# the code multiprocessing runs in a fresh interpreter to start a fork server (multiprocessing/forkserver.py,
# ForkServer.ensure_running): main(listener descriptor, alive descriptor, preloads, **main_path, sys_path)
FORK_SERVER = re.compile(r"from multiprocessing\.forkserver import main; main\((\d+), (\d+), .*'sys_path'")


def python_shim(socket_path: str) -> None:
    """The ``python`` that the zygote's commands give :mod:`multiprocessing` (:func:`_child`): the fork
    server an orchestrator or an env worker starts (``python -c "from multiprocessing.forkserver import main;
    main(5, 7, ...)"``, which imports the environments' modules: verifiers, ~6 s of CPU) forked from the
    zygote instead, with the two descriptors it names at the same numbers; anything else, or a command the
    zygote cannot take, runs in the real interpreter as it would have."""
    args = sys.argv[1:]
    fresh = [sys.executable, *args]
    match = FORK_SERVER.match(args[1]) if len(args) == 2 and args[0] == "-c" else None
    if match is None:
        os.execv(sys.executable, fresh)
    request = {"python_c": args[1], "cwd": os.getcwd(), "env": dict(os.environ)}
    _forward(request, [int(fd) for fd in match.groups()], socket_path, fresh)


def _forward(request: dict, fds: list[int], socket_path: str, fresh: list[str]) -> None:
    """A shim's command forked from the zygote at ``socket_path``, with this process's standard streams and
    ``fds`` (passed at the same numbers); this process waits for it and exits with its code, or becomes
    ``fresh`` where the zygote cannot take it."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(socket_path)
        socket.send_fds(conn, [json.dumps({**request, "fds": fds}).encode()], [0, 1, 2, *fds])
        pid = json.loads(conn.recv(4096) or b'{"code": 86}').get("pid")
    except (OSError, ValueError):
        pid = None
    if pid is None:
        os.execv(sys.executable, fresh)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _: _kill_session(pid, s))
    code = json.loads(conn.recv(4096) or b'{"code": 1}')["code"]
    if code == FRESH:
        os.execv(sys.executable, fresh)
    sys.exit(code if code >= 0 else 128 - code)


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


def _fresh_path(env: dict[str, str], cwd: str) -> list[str] | None:
    """The ``sys.path`` of ``python -m`` started fresh in ``cwd`` with ``env`` (a ``PYTHONPATH`` other than
    the zygote's), or ``None`` where a directory it adds holds a module this process imported from
    elsewhere: the fork would run the zygote's."""
    shown = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        return None
    path = [p for p in json.loads(shown.stdout) if p]  # -c puts "" first where -m puts the working directory
    if not _no_shadowing(path):
        return None
    return list(dict.fromkeys([cwd, *path]))  # a fresh start drops repeats, such as an empty entry's cwd


def _no_shadowing(path: list[str]) -> bool:
    """Whether no directory of ``path`` that this process's ``sys.path`` lacks holds a module this process
    imported from elsewhere (a fork would run the zygote's)."""
    imported = {name.partition(".")[0] for name in sys.modules}
    for entry in set(path) - set(sys.path):
        with contextlib.suppress(OSError):
            if {name.partition(".")[0] for name in os.listdir(entry)} & imported:
                return False
    return True


def _server_path(code: str) -> list[str]:
    """The ``sys_path`` that a fork server's start-up code (:data:`FORK_SERVER`) gives it."""
    return ast.literal_eval(code[code.index("**") + 2 : code.rindex(")")])["sys_path"]


def _child(request: dict, at_start: dict[str, str | None], fds: tuple[int, ...]) -> None:
    """Become ``python -m asyncrl ARGS`` (or ``python -c CODE``: :func:`python_shim`) started in
    ``request["cwd"]`` with ``request["env"]`` and ``fds`` as its standard streams then the descriptors
    numbered ``request["fds"]``; never returns."""
    import multiprocessing

    import setproctitle

    from asyncrl.utils import forked
    from asyncrl.utils.children import _die_with_parent

    code = 1
    streams = (fds[0], fds[1], fds[2])
    try:
        # own session; and a zygote that dies takes its children along (its loop stops them)
        _die_with_parent()
        # the fork servers this command starts come from this zygote too
        multiprocessing.set_executable(os.path.join(os.path.dirname(_serving), "python"))
        os.chdir(request["cwd"])
        if "python_c" in request:
            forked._become_fresh(streams, request["env"])
            _renumber(fds[3:], request["fds"])
            setproctitle.setproctitle(f"{sys.executable} -c {request['python_c']}")
            code = _run_c(request["python_c"]) if _no_shadowing(_server_path(request["python_c"])) else FRESH
            return
        sys.path[0] = request["cwd"]  # where `python -m` looks first
        path = sys.path
        if request["env"].get("PYTHONPATH") != os.environ.get("PYTHONPATH"):
            path = _fresh_path(request["env"], request["cwd"])
        forked._become_fresh(streams, request["env"])
        setproctitle.setproctitle(" ".join([sys.executable, "-m", "asyncrl", *request["args"]]))
        if path is not None and _same_imports(request["args"], at_start):
            sys.path[:] = path
            code = forked._run_module("asyncrl", request["args"])
        else:
            code = FRESH
    except BaseException:  # noqa: BLE001 (the child must never return into the zygote's loop)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _renumber(fds: tuple[int, ...], numbers: list[int]) -> None:
    """Give each of ``fds`` the number of ``numbers`` at its place, inheritable, as a process that inherited
    them from its parent has them (by way of numbers above any of those, so that none is overwritten)."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, number in zip(high, numbers, strict=True):
        os.dup2(fd, number, inheritable=True)
        os.close(fd)


def _run_c(code: str) -> int:
    """``python -c code`` in this process: its own ``__main__``, ``sys.argv``, exit code and exit
    handlers."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"], sys.argv = main, ["-c"]
    status: int = 0
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)  # noqa: S102 (multiprocessing's own code)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    return status


Answer = Callable[[dict], None]


def _fork(request: dict, at_start: dict[str, str | None], fds: tuple[int, ...], answer: Answer,
          children: dict[int, Answer], *close) -> None:  # fmt: skip
    """Fork the command's child and answer its pid; :func:`_reap` answers its exit code when it ends.
    ``fds``: its standard streams, then the descriptors it must have at the numbers ``request["fds"]``
    names."""
    pid = os.fork()
    if pid == 0:
        for s in close:
            s.close()
        _child(request, at_start, fds)
    for fd in set(fds):
        os.close(fd)
    answer({"pid": pid})
    children[pid] = answer


def _reap(children: dict[int, Answer]) -> None:
    """Answer the exit code of every child that ended."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if (answer := children.pop(pid, None)) is not None:
            with contextlib.suppress(OSError):  # a shim gone before its answer
                answer({"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _stop_all(children: dict[int, Answer], grace_s: float = 10) -> None:
    """The worker is gone: its commands still running go too (SIGTERM to each session, SIGKILL past
    ``grace_s``)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in list(children):
            _kill_session(pid, sig)
        deadline = time.monotonic() + grace_s
        while children and time.monotonic() < deadline:
            _reap(children)
            time.sleep(0.05)


def _from_worker(line: bytes, at_start: dict[str, str | None], listener: socket.socket,
                 children: dict[int, Answer]) -> None:  # fmt: skip
    """A test's command: output to the files its request names; or modules to import here
    (:meth:`Zygote.preload`)."""
    request = json.loads(line)
    if "import" in request:
        _import(request["import"])
        return
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    streams = (os.open(os.devnull, os.O_RDONLY), os.open(request["stdout"], flags, 0o644),
               os.open(request["stderr"], flags, 0o644))  # fmt: skip
    _fork(request, at_start, streams, lambda a: print(json.dumps(a), flush=True), children, listener)


def _import(modules: list[str]) -> None:
    """Import ``modules`` in the zygote, and say so; one that leaves a thread running would make every later
    fork unsafe: the zygote stops instead, and the worker's next command reports it."""
    for name in modules:
        importlib.import_module(name)
    if threading.active_count() != 1:
        sys.exit(f"importing {modules} started threads: {threading.enumerate()}")
    print(json.dumps({"imported": modules}), flush=True)


def _from_shim(
    listener: socket.socket, at_start: dict[str, str | None], children: dict[int, Answer]
) -> None:
    """A shim's command: its standard streams are the shim's own descriptors, sent with the request; the
    shim's connection stays open until the command's exit code goes back on it."""
    conn, _ = listener.accept()
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
        request = json.loads(msg)
    except (OSError, ValueError):
        conn.close()
        return
    if len(fds) != 3 + len(request["fds"]) or _startup_env(request["env"]) != at_start:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"code": FRESH}).encode())
        conn.close()
        return

    def answer(a: dict) -> None:
        try:
            conn.send(json.dumps(a).encode())
        finally:
            if "code" in a:
                conn.close()

    try:
        _fork(request, at_start, tuple(fds), answer, children, listener, conn)
    except OSError:  # a shim gone before its answer: its command still runs to its end
        pass


_serving = ""  # the zygote's socket, in its process


def serve(socket_path: str) -> None:
    """Import what the commands import, then fork one child per request, answering its pid at once and its
    exit code when it ends (several run at a time: a test's sidecar and its runs): a line on stdin from the
    test worker, or a shim's connection on ``socket_path``. Ends at the end of stdin, when the test worker
    exits (or dies: its end of the pipe closes with it), stopping the commands still running."""
    import setproctitle

    from asyncrl.utils import forked

    # setproctitle finds the memory it writes titles into at its first call, which must come before a child
    # replaces its environment: otherwise no child, nor any process forked from one (a launcher's), shows its
    # command line
    setproctitle.setproctitle(setproctitle.getproctitle())
    global _serving
    _serving = socket_path
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(8)
    at_start = _startup_env(os.environ)
    forked.preload()
    import asyncrl.cli  # noqa: F401
    import asyncrl.config.compose  # noqa: F401

    # the built-in sidecar's HTTP stack (FastAPI, pydantic, uvicorn), which the launcher's preload leaves to
    # the sidecar: imported here once, not in each of the suite's ~70 sidecars (0.8 s of CPU apiece on a
    # 2-core Xeon: `python -c "from asyncrl.utils import forked; forked.preload(); import asyncrl.cli, time;
    # t = time.process_time(); import asyncrl.inference.serve; print(time.process_time() - t)"`)
    import asyncrl.inference.serve  # noqa: F401

    children: dict[int, Answer] = {}
    pending = b""
    while True:
        # while children run, look for ended ones every 50 ms (a SIGCHLD handler would be inherited by the
        # children)
        ready = select.select([0, listener], [], [], 0.05 if children else None)[0]
        _reap(children)
        if listener in ready:
            _from_shim(listener, at_start, children)
        if 0 in ready:
            chunk = os.read(0, 65536)
            if not chunk:
                _stop_all(children)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                _from_worker(line, at_start, listener, children)


if __name__ == "__main__":
    serve(sys.argv[1])
