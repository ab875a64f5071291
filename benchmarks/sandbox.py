"""The code sandbox's latency and throughput, and whether every verdict is right.

Two programs, each in a right and a wrong version (so a wrong verdict in either direction is caught):
``trivial`` (one test: ``f()`` returns 1) and ``ten_tests`` (a sort-and-dedupe function, 10 hidden tests).
For each, ``--runs`` runs with one client at a time (the pool idle), then with ``--clients`` clients at once
(the pool busy: more clients than warm sandboxes, so each run also waits for a sandbox to be warmed).
Latency is from ``Sandbox.run`` called to its result; runs/s is over the busy phase. The bar: trivial
p99 < 50 ms with no wrong verdict.

    python benchmarks/sandbox.py [--runs 400] [--clients 4] [--workers 0 (= one per CPU)]
                                 [--out benchmarks/results/sandbox_cpu.json]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from _results import pct, report, run_clients

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from asyncrl.sandbox import Sandbox, TestCase  # noqa: E402

TEN = [
    [3, 1, 2],
    [],
    [5, 5, 5],
    [9, -1, 0, 9],
    list(range(20, 0, -1)),
    [1],
    [2, 1],
    [0, 0, 1],
    [7, 3, 7, 3],
    [4],
]
PROGRAMS = {
    "trivial": (
        "def f():\n    return 1\n",
        "def f():\n    return 2\n",
        [TestCase("call", 1, fn="f")],
    ),
    "ten_tests": (
        "def f(xs):\n    return sorted(set(xs))\n",
        "def f(xs):\n    return sorted(xs)\n",  # wrong wherever xs has a duplicate
        [TestCase("call", sorted(set(xs)), fn="f", args=[xs]) for xs in TEN],
    ),
}


def expected_passes(name: str, right: bool) -> list[bool]:
    if right:
        return [True] * len(PROGRAMS[name][2])
    if name == "trivial":
        return [False]
    return [len(set(xs)) == len(xs) for xs in TEN]


def measure(sb: Sandbox, name: str, runs: int, clients: int) -> dict:
    right, wrong, tests = PROGRAMS[name]
    latencies: list[float] = []
    wrong_verdicts = 0
    lock = threading.Lock()
    counter = iter(range(runs))

    def client() -> None:
        nonlocal wrong_verdicts
        for k in counter:
            ok = k % 2 == 0
            start = time.perf_counter()
            result = sb.run(right if ok else wrong, tests)
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                wrong_verdicts += [t.passed for t in result.tests] != expected_passes(name, ok)

    wall = run_clients(clients, client)
    ms = [x * 1e3 for x in latencies]
    return {
        "program": name,
        "clients": clients,
        "runs": len(ms),
        "p50_ms": round(pct(ms, 50), 2),
        "p99_ms": round(pct(ms, 99), 2),
        "max_ms": round(max(ms), 2),
        "runs_per_s": round(len(ms) / wall, 1),
        "wrong_verdicts": wrong_verdicts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/sandbox_cpu.json")
    args = ap.parse_args()
    rows = []
    with Sandbox(workers=args.workers) as sb:
        for name in PROGRAMS:
            measure(sb, name, 20, 1)  # warm-up: imports, page cache
            for clients in (1, args.clients):
                rows.append(measure(sb, name, args.runs, clients))
        workers = sb.size
    columns = {
        "clients": "clients",
        "runs": "runs",
        "p50 ms": "p50_ms",
        "p99 ms": "p99_ms",
        "max ms": "max_ms",
    }
    columns |= {"runs/s": "runs_per_s", "wrong": "wrong_verdicts"}
    report(args.out, "program", columns, rows, workers=workers)


if __name__ == "__main__":
    main()
