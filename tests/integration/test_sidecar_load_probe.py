"""benchmarks/sidecar_load.py's ``/health`` prober runs open loop: against a server whose event loop blocks
for a second, every probe scheduled in that second waits and counts, not just the one that was out when it
began."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import httpx

from asyncrl.utils.process import free_port

ROOT = Path(__file__).resolve().parents[2]

# /stall blocks the server's event loop for 1 s: no other request is answered meanwhile
STALLING_SERVER = """
import sys, time
import uvicorn
from fastapi import FastAPI

app = FastAPI()

@app.get("/health")
async def health():
    return {"status": "ok"}

@app.get("/stall")
async def stall():
    time.sleep(1.0)
    return {}

uvicorn.run(app, port=int(sys.argv[1]), log_level="warning")
"""


def test_a_one_second_stall_counts_for_every_probe_scheduled_in_it(monkeypatch):
    # the spawned prober imports the script from there too
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from sidecar_load import probe_health

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", STALLING_SERVER, str(port)])
    try:
        ctx = multiprocessing.get_context("spawn")
        ready, stop, (receive, send) = ctx.Event(), ctx.Event(), ctx.Pipe(duplex=False)
        prober = ctx.Process(target=probe_health, args=(port, 0.01, ready, stop, send))
        prober.start()
        assert ready.wait(60), "the server never answered /health"
        time.sleep(0.3)
        assert httpx.get(f"http://127.0.0.1:{port}/stall", timeout=10).status_code == 200
        time.sleep(0.3)
        stop.set()
        latencies, _, probes, failures = receive.recv()
        prober.join(30)
    finally:
        server.kill()
        server.wait()
    assert not failures and probes == len(latencies) > 100
    # ~100 probes fall in the stall, the first of them waiting nearly all of it; a closed loop would see one
    stalled = [x for x in latencies if x > 0.3]
    assert len(stalled) >= 50 and max(latencies) > 0.8, (len(stalled), max(latencies))
