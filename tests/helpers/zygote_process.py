"""The zygote's own process (``python tests/helpers/zygote_process.py SOCKET``, started by
:class:`helpers.zygote.Zygote`): it imports what the commands import, then forks one child per command,
from its test worker's requests on stdin or from a shim's on its socket; and the shims, the ``asyncrl`` and
``python`` executables that hand the zygote a command the test does not start itself (DVC's stages,
``multiprocessing``'s fork servers). :mod:`helpers.zygote` says why and when a command forks.
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
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable

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


def _startup_env(env) -> dict[str, str | None]:
    from asyncrl.numerics import READ_AT_IMPORT

    return {k: env.get(k) for k in (*READ_AT_IMPORT, *STARTUP)}


def _kill_session(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def shim() -> None:
    """The ``asyncrl`` of ``helpers.zygote.shim_env``: this command forked from the zygote, its exit code
    this process's; a signal that stops this process stops the command's session too. Fresh where the
    zygote cannot take it."""
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
    # a Python whose fork server takes a third descriptor (3.14's authentication key) starts it fresh
    if match is None or "authkey" in args[1]:
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
        pid = json.loads(conn.recv(4096) or json.dumps({"code": FRESH})).get("pid")
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
