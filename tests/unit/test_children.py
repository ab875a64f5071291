"""``wait_healthy``, which the launcher and the tests run while a sidecar loads its model: it polls over one
connection pool, and names a process that dies before it answers."""

from __future__ import annotations

import contextlib
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncrl.utils.children import spawn, stop, wait_healthy
from asyncrl.utils.process import ProcessFailed


@contextlib.contextmanager
def health_after(misses: int):
    """A server whose ``/health`` answers 503 ``misses`` times, then 200; yields its URL and the poll
    count."""
    polls = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            polls[0] += 1
            self.send_response(503 if polls[0] <= misses else 200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", polls
    finally:
        server.shutdown()
        server.server_close()


def test_polling_until_healthy_loads_the_ca_bundle_once(tmp_path, monkeypatch):
    """Each new httpx client loads the CA bundle (~50 ms of CPU): a client per poll would cost a launcher
    more CPU than the loading sidecar it waits for can spare on a small machine."""
    opened = []
    load = ssl.SSLContext.load_verify_locations

    def counted(self, *args, **kwargs):
        opened.append(1)
        return load(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    proc = spawn("sidecar", ["sleep", "60"], tmp_path / "sidecar.log")
    try:
        with health_after(misses=5) as (url, polls):
            wait_healthy(proc, url, timeout_s=30)
    finally:
        stop([proc], timeout_s=5)
    assert polls[0] == 6 and len(opened) == 1


def test_a_process_that_dies_while_loading_is_named_with_its_log(tmp_path):
    log = tmp_path / "sidecar.log"
    proc = spawn("sidecar", ["sh", "-c", "echo cannot load the model; exit 3"], log)
    proc.popen.wait()
    with health_after(misses=1000) as (url, _), pytest.raises(ProcessFailed) as e:
        wait_healthy(proc, url, timeout_s=30)
    assert "sidecar exited with code 3" in str(e.value) and str(log) in str(e.value)
    assert "cannot load the model" in str(e.value)
