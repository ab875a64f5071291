"""The CPU sidecar under load: request latency and ``/health`` latency with 64, 512 and 1,024 requests in flight.

Starts ``asyncrl serve`` on the tiny model that `make run` builds (or ``--model``), then for each level sends
that many chat requests at once (each its own connection; 1 sample of ``--max-tokens`` tokens) while a second
client, in a process of its own (so the load generator's event loop does not delay it), polls ``/health``
every 20 ms over one keep-alive connection. Reports request p50/p99, ``/health`` p50/p99/max, and failures: a
refused, reset or timed-out connection, or any 5xx. The bar: ``/health`` p99 < 100 ms and no
dropped connection at 1,024.

Side by side, interleaved, ``--repeats`` times: the engine in its own process (the default) and in the
server's process (``inference.engine_process=false``). Prints the median of each number over the repeats
per level and engine, and the in-process / own-process ratio of ``/health`` p99; writes every run to JSON.

    python benchmarks/sidecar_load.py [--levels 64 512 1024] [--repeats 3] [--engines process inprocess]
                                      [--out benchmarks/results/sidecar_load_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_results

ROOT = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def poll_health(port: int, ready, stop, out) -> None:
    """In its own process: GET /health every 20 ms until ``stop`` is set (``ready`` once the first poll is
    answered); send (latencies, failures) to ``out``."""
    latencies: list[float] = []
    failures: dict[str, int] = {}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        start = time.perf_counter()
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                failures[f"health http {response.status}"] = failures.get(f"health http {response.status}", 0) + 1
            else:
                latencies.append(time.perf_counter() - start)
                ready.set()
        except (OSError, http.client.HTTPException) as e:
            failures[f"health {type(e).__name__}"] = failures.get(f"health {type(e).__name__}", 0) + 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        time.sleep(0.02)
    out.send((latencies, failures))


async def level(url: str, concurrency: int, max_tokens: int) -> dict:
    import httpx

    body = {"messages": [{"role": "user", "content": "reverse: abcdef"}], "max_tokens": max_tokens, "seed": 1}
    latencies: list[float] = []
    failures: dict[str, int] = {}

    async def one(client: httpx.AsyncClient) -> None:
        start = time.perf_counter()
        try:
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code != 200:
                failures[f"http {r.status_code}"] = failures.get(f"http {r.status_code}", 0) + 1
                return
            latencies.append(time.perf_counter() - start)
        except httpx.HTTPError as e:
            failures[type(e).__name__] = failures.get(type(e).__name__, 0) + 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    ctx = multiprocessing.get_context("spawn")
    ready, stop, (receive, send) = ctx.Event(), ctx.Event(), ctx.Pipe(duplex=False)
    poller = ctx.Process(target=poll_health, args=(int(url.rsplit(":", 1)[1]), ready, stop, send))
    poller.start()
    ready.wait(60)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    stop.set()
    health, health_failures = receive.recv()
    poller.join()
    failures.update(health_failures)
    return {
        "concurrency": concurrency,
        "wall_s": wall,
        "ok": len(latencies),
        "failures": failures,
        "request_p50_s": pct(latencies, 50),
        "request_p99_s": pct(latencies, 99),
        "health_polls": len(health),
        "health_p50_ms": 1000 * pct(health, 50),
        "health_p99_ms": 1000 * pct(health, 99),
        "health_max_ms": 1000 * max(health, default=float("nan")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "outputs" / "models" / "tiny"))
    ap.add_argument("--levels", type=int, nargs="+", default=[64, 512, 1024])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", nargs="+", choices=["process", "inprocess"], default=["process", "inprocess"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sidecar_load_cpu.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from asyncrl.launcher.process import spawn, stop, wait_healthy
    from asyncrl.numerics import cpu_info
    from asyncrl.utils.process import free_port

    def one_server(engine: str) -> list[dict]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(tempfile.mkdtemp(prefix="sidecar-load-")) / "inference.log"
        argv = [sys.executable, "-m", "asyncrl", "serve", "experiment=reverse_text", f"model.name={a.model}"]
        argv += [f"inference.port={port}", f"inference.engine_process={engine == 'process'}"]
        proc = spawn("inference", argv, log)
        try:
            wait_healthy(proc, url, 180)
            asyncio.run(level(url, 8, a.max_tokens))  # warm-up
            return [{"engine": engine, **asyncio.run(level(url, n, a.max_tokens))} for n in a.levels]
        finally:
            stop([proc], 30)

    runs: list[dict] = []
    for repeat in range(a.repeats):
        for engine in a.engines:
            runs += [{"repeat": repeat, **r} for r in one_server(engine)]
            print(f"repeat {repeat}, engine {engine}: done", flush=True)
    keys = ("request_p50_s", "request_p99_s", "health_p50_ms", "health_p99_ms", "health_max_ms")
    medians = []
    for engine in a.engines:
        for n in a.levels:
            mine = [r for r in runs if r["engine"] == engine and r["concurrency"] == n]
            failures: dict[str, int] = {}
            for r in mine:
                for k, v in r["failures"].items():
                    failures[k] = failures.get(k, 0) + v
            medians.append(
                {
                    "engine": engine,
                    "concurrency": n,
                    "ok": sum(r["ok"] for r in mine),
                    "sent": n * len(mine),
                    "failures": failures,
                    **{k: statistics.median(r[k] for r in mine) for k in keys},
                }
            )
    print(f"medians of {a.repeats} interleaved repeats")
    print(
        f"{'engine':>9} {'in flight':>9} {'ok/sent':>11} {'failures':>14} {'req p50 s':>9} {'req p99 s':>9} "
        f"{'health p50 ms':>13} {'p99 ms':>7} {'max ms':>7}"
    )
    for r in medians:
        print(
            f"{r['engine']:>9} {r['concurrency']:>9} {r['ok']:>5}/{r['sent']:<5} {str(r['failures'] or '-'):>14} "
            f"{r['request_p50_s']:>9.2f} {r['request_p99_s']:>9.2f} {r['health_p50_ms']:>13.1f} "
            f"{r['health_p99_ms']:>7.1f} {r['health_max_ms']:>7.1f}"
        )
    ratios = {}
    if {"process", "inprocess"} <= set(a.engines):
        by = {(r["engine"], r["concurrency"]): r for r in medians}
        ratios = {n: by["inprocess", n]["health_p99_ms"] / by["process", n]["health_p99_ms"] for n in a.levels}
        print("health p99, in-process / own process: " + ", ".join(f"{n}: {x:.2f}x" for n, x in ratios.items()))
    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT).stdout
    write_results(
        a.out,
        {
            "benchmark": "sidecar_load",
            "command": "benchmarks/sidecar_load.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"),
            "git": git.strip(),
            "machine": {"cpu": cpu_info()["model"], "cpus": os.cpu_count(), "platform": platform.platform()},
            "model": a.model,
            "max_tokens": a.max_tokens,
            "repeats": a.repeats,
            "medians": medians,
            "health_p99_ratio_inprocess_vs_process": ratios,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
