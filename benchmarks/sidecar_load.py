"""The CPU sidecar under load: request latency and ``/health`` latency with 64, 512 and 1,024 requests in
flight.

Starts ``asyncrl serve`` on the tiny model that `make run` builds (or ``--model``), then for each level sends
that many chat requests at once (each its own connection; 1 sample of ``--max-tokens`` tokens) while a
prober, in a process of its own (so the load generator's event loop does not delay it), sends ``/health``
open loop: one probe every ``--probe-ms`` (10 ms) on a fixed schedule whether or not earlier ones were
answered, each probe's latency taken from its scheduled send time. A stall of the server then counts once for
every probe scheduled during it, as it would for every client that called in that time; a closed loop (wait
for the answer, then send the next) would count a 3 s stall as one sample among hundreds. The prober's own
lateness (a probe sent after its scheduled time because the prober did not get the CPU) is part of each
latency and reported apart as the send lag. Reports request p50/p99, ``/health`` p50/p99/max, the number of
probes and failures: a refused, reset or timed-out connection, or any 5xx. The bar: ``/health`` p99 < 100 ms
and no dropped connection at 1,024.

Side by side, interleaved, ``--repeats`` times: the engine in its own process (the default) and in the
server's process (``inference.engine_process=false``). Prints the median of each number over the repeats
per level and engine with its spread (lowest-highest), and the in-process / own-process ratio of ``/health``
p99; writes every run to JSON.

    python benchmarks/sidecar_load.py [--levels 64 512 1024] [--repeats 3] [--engines process inprocess]
                                      [--probe-ms 10] [--out
                                      benchmarks/results/sidecar_load_open_loop_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
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


def count(failures: dict[str, int], key: str) -> None:
    failures[key] = failures.get(key, 0) + 1


def probe_health(port: int, period_s: float, ready, stop, out) -> None:
    """In its own process: wait until ``/health`` answers (then set ``ready``), probe it open loop every
    ``period_s`` until ``stop`` is set, wait for the probes still out, and send (latencies, send lags,
    scheduled count, failures) to ``out``."""
    out.send(asyncio.run(_probe(port, period_s, ready, stop)))


HEALTH_GET = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


async def get_health(port: int, timeout_s: float = 30) -> int:
    """One ``GET /health`` on a connection of its own; the answer's status code. A bare asyncio stream, not
    httpx: with hundreds of probes out during a stall, httpx's connection pool spends milliseconds of the
    prober's CPU per probe, the prober falls behind its schedule, and its own backlog is then counted as the
    server's stall (the server's own timestamps showed it answering within milliseconds, idle, while the
    probes waited in the prober for up to 20 s)."""

    async def get() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(HEALTH_GET)
            status = await reader.readline()
            await reader.read()  # the rest, until the server closes (Connection: close)
        finally:
            writer.close()
        return int(status.split()[1])

    return await asyncio.wait_for(get(), timeout_s)


async def _probe(port: int, period_s: float, ready, stop) -> tuple[list[float], list[float], int, dict[str, int]]:
    latencies: list[float] = []
    lags: list[float] = []
    failures: dict[str, int] = {}

    async def one(due: float) -> None:
        lags.append(time.perf_counter() - due)
        try:
            if (status := await get_health(port)) != 200:
                count(failures, f"health http {status}")
            else:
                latencies.append(time.perf_counter() - due)
        except (OSError, ValueError, IndexError, TimeoutError) as e:  # refused, reset, timed out or garbled
            count(failures, f"health {type(e).__name__}")

    while True:
        try:
            if await get_health(port) == 200:
                break
        except (OSError, ValueError, IndexError, TimeoutError):
            pass
        await asyncio.sleep(0.05)
    ready.set()
    probes: list[asyncio.Task] = []
    start = time.perf_counter()
    while not stop.is_set():
        due = start + len(probes) * period_s
        if (wait := due - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        probes.append(asyncio.create_task(one(due)))
    await asyncio.gather(*probes)
    return latencies, lags, len(probes), failures


async def level(url: str, concurrency: int, max_tokens: int, probe_s: float) -> dict:
    import httpx

    body = {
        "messages": [{"role": "user", "content": "reverse: abcdef"}],
        "max_tokens": max_tokens,
        "seed": 1,
    }
    latencies: list[float] = []
    failures: dict[str, int] = {}

    async def one(client: httpx.AsyncClient) -> None:
        start = time.perf_counter()
        try:
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code != 200:
                count(failures, f"http {r.status_code}")
                return
            latencies.append(time.perf_counter() - start)
        except httpx.HTTPError as e:
            count(failures, type(e).__name__)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    ctx = multiprocessing.get_context("spawn")
    ready, stop, (receive, send) = ctx.Event(), ctx.Event(), ctx.Pipe(duplex=False)
    prober = ctx.Process(target=probe_health, args=(int(url.rsplit(":", 1)[1]), probe_s, ready, stop, send))
    prober.start()
    ready.wait(60)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    stop.set()
    health, lags, probes, health_failures = receive.recv()
    prober.join()
    failures.update(health_failures)
    return {
        "concurrency": concurrency,
        "wall_s": wall,
        "ok": len(latencies),
        "failures": failures,
        "request_p50_s": pct(latencies, 50),
        "request_p99_s": pct(latencies, 99),
        "health_probes": probes,
        "health_answered": len(health),
        "health_p50_ms": 1000 * pct(health, 50),
        "health_p99_ms": 1000 * pct(health, 99),
        "health_max_ms": 1000 * max(health, default=float("nan")),
        "probe_send_lag_p99_ms": 1000 * pct(lags, 99),
    }


KEYS = (
    "request_p50_s",
    "request_p99_s",
    "health_p50_ms",
    "health_p99_ms",
    "health_max_ms",
    "probe_send_lag_p99_ms",
)


def summarize(runs: list[dict], engines: list[str], levels: list[int]) -> list[dict]:
    """Per engine and level: requests and probes summed over the repeats, each latency's median and its
    lowest and highest value (``<key>_range``)."""
    rows = []
    for engine in engines:
        for n in levels:
            mine = [r for r in runs if r["engine"] == engine and r["concurrency"] == n]
            failures: dict[str, int] = {}
            for r in mine:
                for k, v in r["failures"].items():
                    failures[k] = failures.get(k, 0) + v
            rows.append(
                {
                    "engine": engine,
                    "concurrency": n,
                    "ok": sum(r["ok"] for r in mine),
                    "sent": n * len(mine),
                    "health_probes": sum(r["health_probes"] for r in mine),
                    "failures": failures,
                    **{k: statistics.median(r[k] for r in mine) for k in KEYS},
                    **{f"{k}_range": [min(r[k] for r in mine), max(r[k] for r in mine)] for k in KEYS},
                }
            )
    return rows


def print_table(rows: list[dict], repeats: int) -> None:
    def spread(r: dict, key: str, fmt: str) -> str:
        low, high = r[f"{key}_range"]
        return f"{r[key]:{fmt}} ({low:{fmt}}-{high:{fmt}})"

    print(f"medians (lowest-highest) of {repeats} interleaved repeats; /health open loop")
    print(
        f"{'engine':>9} {'in flight':>9} {'ok/sent':>11} {'probes':>7} {'failures':>14} {'req p99 s':>18} "
        f"{'health p50 ms':>18} {'p99 ms':>20} {'max ms':>22} {'send lag p99 ms':>20}"
    )
    for r in rows:
        print(
            f"{r['engine']:>9} {r['concurrency']:>9} {r['ok']:>5}/{r['sent']:<5} {r['health_probes']:>7} "
            f"{str(r['failures'] or '-'):>14} {spread(r, 'request_p99_s', '.2f'):>18} "
            f"{spread(r, 'health_p50_ms', '.1f'):>18} {spread(r, 'health_p99_ms', '.1f'):>20} "
            f"{spread(r, 'health_max_ms', '.0f'):>22} {spread(r, 'probe_send_lag_p99_ms', '.1f'):>20}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "outputs" / "models" / "tiny"))
    ap.add_argument("--levels", type=int, nargs="+", default=[64, 512, 1024])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", nargs="+", choices=["process", "inprocess"], default=["process", "inprocess"])
    ap.add_argument("--probe-ms", type=float, default=10.0, help="the /health probes' fixed interval")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sidecar_load_open_loop_cpu.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from asyncrl.numerics import cpu_info
    from asyncrl.utils.children import spawn, stop, wait_healthy
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
            asyncio.run(level(url, 8, a.max_tokens, a.probe_ms / 1000))  # warm-up
            return [{"engine": engine, **asyncio.run(level(url, n, a.max_tokens, a.probe_ms / 1000))} for n in a.levels]
        finally:
            stop([proc], 30)

    runs: list[dict] = []
    for repeat in range(a.repeats):
        for engine in a.engines:
            runs += [{"repeat": repeat, **r} for r in one_server(engine)]
            print(f"repeat {repeat}, engine {engine}: done", flush=True)
    medians = summarize(runs, a.engines, a.levels)
    print_table(medians, a.repeats)
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
            "health_probe": {"loop": "open", "interval_ms": a.probe_ms},
            "medians": medians,
            "health_p99_ratio_inprocess_vs_process": ratios,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
