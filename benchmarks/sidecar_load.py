"""The CPU sidecar under load: request latency and ``/health`` latency with 64, 512 and 1,024 requests in flight.

Starts ``asyncrl serve`` on the tiny model that `make run` builds (or ``--model``), then for each level sends
that many chat requests at once (each its own connection; 1 sample of ``--max-tokens`` tokens) while a second
client polls ``/health`` every 20 ms. Reports request p50/p99, ``/health`` p50/p99/max, and failures: a
refused, reset or timed-out connection, or any 5xx. Goal (issue 11): ``/health`` p99 < 100 ms and no
dropped connection at 1,024. Prints a table and writes JSON.

    python benchmarks/sidecar_load.py [--levels 64 512 1024] [--out benchmarks/results/sidecar_load_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
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


async def level(url: str, concurrency: int, max_tokens: int) -> dict:
    import httpx

    body = {"messages": [{"role": "user", "content": "reverse: abcdef"}], "max_tokens": max_tokens, "seed": 1}
    latencies: list[float] = []
    failures: dict[str, int] = {}
    health: list[float] = []
    done = asyncio.Event()

    async def one(client: httpx.AsyncClient) -> None:
        start = time.perf_counter()
        try:
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code >= 500:
                failures[f"http {r.status_code}"] = failures.get(f"http {r.status_code}", 0) + 1
                return
            if r.status_code != 200:
                failures[f"http {r.status_code}"] = failures.get(f"http {r.status_code}", 0) + 1
                return
            latencies.append(time.perf_counter() - start)
        except httpx.HTTPError as e:
            failures[type(e).__name__] = failures.get(type(e).__name__, 0) + 1

    async def poll() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                try:
                    await client.get(f"{url}/health")
                    health.append(time.perf_counter() - start)
                except httpx.HTTPError as e:
                    failures[f"health {type(e).__name__}"] = failures.get(f"health {type(e).__name__}", 0) + 1
                await asyncio.sleep(0.02)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        poller = asyncio.create_task(poll())
        start = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
        done.set()
        await poller
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
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sidecar_load_cpu.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from asyncrl.launcher.process import spawn, stop, wait_healthy
    from asyncrl.numerics import cpu_info
    from asyncrl.utils.process import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="sidecar-load-")) / "inference.log"
    argv = [
        sys.executable,
        "-m",
        "asyncrl",
        "serve",
        "experiment=reverse_text",
        f"model.name={a.model}",
        f"inference.port={port}",
    ]
    proc = spawn("inference", argv, log)
    print(f"sidecar log: {log}")
    try:
        wait_healthy(proc, url, 180)
        asyncio.run(level(url, 8, a.max_tokens))  # warm-up
        rows = [asyncio.run(level(url, n, a.max_tokens)) for n in a.levels]
    finally:
        stop([proc], 30)
    print(
        f"{'in flight':>9} {'ok':>5} {'failures':>20} {'req p50 s':>9} {'req p99 s':>9} "
        f"{'health p50 ms':>13} {'p99 ms':>7} {'max ms':>7}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>9} {r['ok']:>5} {str(r['failures'] or '-'):>20} {r['request_p50_s']:>9.2f} "
            f"{r['request_p99_s']:>9.2f} {r['health_p50_ms']:>13.1f} {r['health_p99_ms']:>7.1f} "
            f"{r['health_max_ms']:>7.1f}"
        )
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
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
            "levels": rows,
        },
    )


if __name__ == "__main__":
    main()
