"""An untrusted agent program, run in a sandbox whose one way out is its own rollout's OpenAI endpoint.

The sandbox is the code sandbox's bubble (:func:`asyncrl.sandbox.isolation.bubble`: no host files, no
network, no environment, the seccomp filter) started for one episode, with the episode's working directory
bound in writable at ``/work``, the interpreter (and the virtual environment, where the sandbox user can read
it) and ``paths`` bound in read-only. Its first process, :mod:`asyncrl.sandbox.relay`, gives the agent a
loopback port that leads to a Unix socket bound in from here, served by :class:`EndpointProxy`: the proxy
forwards ``/v1/...`` requests, and nothing else, to the rollout's base URL on the sidecar. So the agent
reaches its own rollout's chat completions and model list, never the sidecar's admin routes, another rollout,
the host's network or the orchestrator.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import h11
import httpx

from asyncrl.sandbox.bounds import seccomp_fd
from asyncrl.sandbox.isolation import (
    NOBODY,
    SandboxUnavailable,
    bubble,
    bwrap_binary,
    interpreter,
    reachable_bwrap,
    reachable_by_others,
    run_as,
)

SOCKET_DIR = "/run/asyncrl"  # where the proxy's socket is, inside
WORKDIR = "/work"  # the episode's working directory, inside
MAX_BODY = 16 << 20  # bytes of a request body the proxy reads (a chat request with its history)
OUTPUT_TAIL = 65_536  # bytes of an agent's stdout and stderr kept (for its reward and the samples file)
MAX_REQUESTS = 8  # requests of one agent read and forwarded at once (each holds its body: MAX_BODY at most)
FORWARDED = (b"content-type", b"accept")  # request headers passed on; the agent's key and host are not


@dataclass(frozen=True)
class AgentLimits:
    """Rlimits of every process of the agent (the relay sets them before it starts the agent)."""

    memory_mb: int = 4096  # address space per process
    nproc: int = 256  # processes and threads of the sandbox user
    file_size_mb: int = 256  # largest file it may write
    tmpfs_mb: int = 256  # its private /tmp (memory)


class EndpointProxy:
    """Serves one rollout's endpoint on a Unix socket: ``/v1/<rest>`` goes to ``<base_url>/<rest>`` (streamed
    back as it comes), anything else is answered here with a 4xx and goes nowhere."""

    def __init__(self, base_url: str, timeout_s: float, transport: httpx.AsyncBaseTransport | None = None):
        """``transport``: the upstream's (default: the network's). Nothing is opened before the proxy is
        entered."""
        self.base_url = base_url.rstrip("/")
        self._client_args: dict = {"timeout": timeout_s, "transport": transport}
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(MAX_REQUESTS)

    async def __aenter__(self) -> EndpointProxy:
        self.http = httpx.AsyncClient(**self._client_args)
        self.dir = Path(tempfile.mkdtemp(prefix="asyncrl-endpoint-"))
        self.path = self.dir / "endpoint.sock"
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        self.dir.chmod(0o755)  # the sandbox's user (nobody, when we are root) connects to the socket
        self.path.chmod(0o666)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        await self.http.aclose()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        conn = h11.Connection(h11.SERVER)
        try:
            while await self._one(conn, reader, writer):
                conn.start_next_cycle()
        except h11.RemoteProtocolError as e:  # not HTTP/1.1: told so, and the connection ends
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                with contextlib.suppress(h11.ProtocolError, ConnectionError):
                    await _error(conn, writer, e.error_status_hint, f"a malformed request: {e}")
        except (h11.ProtocolError, ConnectionError):
            pass  # a dropped connection ends; the rollout goes on
        finally:
            self._conns.discard(task)
            writer.close()

    async def _one(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; whether the connection may carry another. Its body is read, and the request
        forwarded, only in one of :data:`MAX_REQUESTS` slots: what an agent makes this process hold stays
        bounded however many connections it opens (an idle kept-alive connection holds no slot)."""
        event = await _next(conn, reader)
        if not isinstance(event, h11.Request):
            return False  # closed between requests
        if int(dict(event.headers).get(b"content-length", b"0")) > MAX_BODY:  # a number: h11 has checked it
            await _error(conn, writer, 413, f"a request body over {MAX_BODY >> 20} MiB")
            return False
        async with self._slots:
            body = bytearray()
            while not isinstance(part := await _next(conn, reader), h11.EndOfMessage):
                if not isinstance(part, h11.Data):
                    return False  # the connection closed mid-request
                body += part.data
                if len(body) > MAX_BODY:
                    await _error(conn, writer, 413, f"a request body over {MAX_BODY >> 20} MiB")
                    return False
            url = self._target(event.target.decode("latin-1"))
            if url is None:
                await _error(conn, writer, 404, "this endpoint serves /v1/... only")
            else:
                await self._forward(conn, writer, event, url, bytes(body))
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    def _target(self, target: str) -> str | None:
        """The sidecar URL for a request target, or None for one outside ``/v1/`` (dot segments included)."""
        parts = urlsplit(target)
        segments = unquote(parts.path).split("/")
        if (
            parts.scheme
            or parts.netloc
            or segments[:2] != ["", "v1"]
            or any(s in (".", "..") for s in segments)
        ):
            return None
        rest = parts.path[len("/v1") :]
        return f"{self.base_url}{rest}" + (f"?{parts.query}" if parts.query else "")

    async def _forward(self, conn, writer, request: h11.Request, url: str, body: bytes) -> None:
        headers = [(k, v) for k, v in request.headers if k in FORWARDED]
        try:
            async with self.http.stream(request.method.decode(), url, content=body, headers=headers) as r:
                kept = (
                    [(b"content-type", r.headers["content-type"].encode())]
                    if "content-type" in r.headers
                    else []
                )
                writer.write(conn.send(h11.Response(status_code=r.status_code, headers=kept)))
                async for chunk in r.aiter_bytes():
                    writer.write(conn.send(h11.Data(data=chunk)))
                    await writer.drain()
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
        except httpx.HTTPError as e:
            if conn.our_state is h11.SEND_RESPONSE:
                await _error(conn, writer, 502, f"the sidecar did not answer: {type(e).__name__}")
            else:
                raise ConnectionError("the sidecar's answer broke off") from None


async def _next(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    """The connection's next HTTP event, reading from ``reader`` as h11 needs."""
    while (event := conn.next_event()) is h11.NEED_DATA:
        conn.receive_data(await reader.read(65536))
    return event


async def _error(conn: h11.Connection, writer: asyncio.StreamWriter, status: int, message: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
    writer.write(conn.send(h11.Data(data=body)))
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()


async def run_sandboxed(
    argv: list[str],
    env: dict[str, str],
    workdir: str,
    base_url: str,
    url_names: tuple[str, ...],
    timeout_s: float,
    limits: AgentLimits,
    paths: tuple[str, ...] = (),
) -> tuple[int, bytes, bytes]:
    """Run ``argv`` in a sandbox (``workdir`` at :data:`WORKDIR`, its working directory; ``paths`` read-only
    and on ``PYTHONPATH``) with ``env``, where the variables ``url_names`` lead to ``base_url`` through the
    proxy; its exit status, stdout and stderr. ``TimeoutError`` past ``timeout_s``, the sandbox killed."""
    user = run_as()
    python, prefix = interpreter(as_other_user=user is not None)
    bwrap = bwrap_binary()
    if user is not None:  # the sandbox runs as nobody: the episode's directory is its
        bwrap = reachable_bwrap(bwrap)
        for p in [workdir, *(str(q) for q in Path(workdir).rglob("*"))]:
            os.chown(p, NOBODY, NOBODY)
    venv = (
        sys.prefix
        if sys.prefix != sys.base_prefix and (user is None or reachable_by_others(Path(sys.prefix)))
        else None
    )
    binds = [(workdir, WORKDIR, True), *((p, p, False) for p in paths)] + (
        [(venv, venv, False)] if venv else []
    )
    bins = [f"{venv}/bin"] if venv else []
    inside = {
        "PATH": ":".join([*bins, f"{prefix}/bin", "/usr/bin", "/bin"]),
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        **({"PYTHONPATH": ":".join(paths)} if paths else {}),
        **env,
    }
    # the relay's port, once it has one
    inside.update(dict.fromkeys(url_names, "http://127.0.0.1:{port}/v1"))
    async with EndpointProxy(base_url, timeout_s) as proxy:
        binds.append((str(proxy.dir), SOCKET_DIR, False))
        job = {
            "argv": argv,
            "cwd": WORKDIR,
            "env": inside,
            "socket": f"{SOCKET_DIR}/{proxy.path.name}",
            "port_env": list(url_names),
            "limits": {
                "memory_mb": limits.memory_mb,
                "nproc": limits.nproc,
                "file_size_mb": limits.file_size_mb,
            },
        }
        return await _bubble(bwrap, python, prefix, limits.tmpfs_mb, tuple(binds), job, user, timeout_s)


async def _bubble(bwrap, python, prefix, tmpfs_mb, binds, job, user, timeout_s) -> tuple[int, bytes, bytes]:
    """Start the bubble with the relay as its first process; ``SandboxUnavailable`` if bwrap could not set it
    up (told by bwrap's info pipe, which it writes once the namespaces exist: nothing the agent prints can
    fake it)."""
    source = _relay_source()
    filter_r = seccomp_fd()
    info_r, info_w = os.pipe()
    head = bubble(bwrap, prefix, tmpfs_mb, filter_r, info_fd=info_w, binds=binds)
    kwargs: dict[str, Any] = {"user": user[0], "group": user[1], "extra_groups": []} if user else {}
    try:
        proc = await asyncio.create_subprocess_exec(
            *head, python, "-I", "-S", "-B", "-c", source, json.dumps(job),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={},  # nothing of ours, not even for bwrap
            pass_fds=(filter_r, info_w),
            start_new_session=True,
            **kwargs,
        )  # fmt: skip
    except BaseException:
        os.close(info_r)
        raise
    finally:
        os.close(filter_r)
        os.close(info_w)
    try:
        out, err = await outputs_within(proc, timeout_s)  # past it, the bubble goes
    finally:
        with os.fdopen(info_r, "rb") as info:  # bwrap has exited: its end is closed
            started = bool(info.read().strip())
    if not started:
        raise SandboxUnavailable(
            f"the agent's sandbox did not start: {err.decode(errors='replace')[-500:].strip()}"
        )
    assert proc.returncode is not None
    return proc.returncode, out, err


async def outputs_within(proc: asyncio.subprocess.Process, timeout_s: float) -> tuple[bytes, bytes]:
    """``proc``'s stdout and stderr (the last :data:`OUTPUT_TAIL` bytes of each: a program that writes
    without end costs this process no more) once it exits; ``TimeoutError`` past ``timeout_s``. If it is
    still running then (its deadline, or the episode cancelled), its process group is killed and reaped."""
    assert proc.stdout is not None and proc.stderr is not None
    try:
        out, err, _ = await asyncio.wait_for(
            asyncio.gather(_tail(proc.stdout), _tail(proc.stderr), proc.wait()), timeout_s
        )
        return out, err
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def _tail(stream: asyncio.StreamReader) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk
        del kept[:-OUTPUT_TAIL]
    return bytes(kept)


@functools.cache
def _relay_source() -> str:
    return files("asyncrl.sandbox").joinpath("relay.py").read_text()


def sandbox_path_problem(path: str) -> str | None:
    """Why the sandbox cannot bind ``path`` for its user, or None."""
    if not Path(path).is_absolute():
        return "is not an absolute path"
    if not Path(path).exists():
        return "does not exist"
    if run_as() is not None and not reachable_by_others(Path(path)):
        return (
            "is not readable by the sandbox's user (nobody: asyncrl runs as root); make it and its parents "
            "readable"
        )
    return None
