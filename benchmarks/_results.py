"""What the benchmarks share: step times from metrics files, the JSON they write, attention's FLOPs."""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path


def run_clients(clients: int, client) -> float:
    """Run ``client()`` in ``clients`` threads at once; the wall seconds until the last one returns."""
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def pct(values: list[float], q: int) -> float:
    """The ``q``-th percentile (inclusive method; a single value is every percentile)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def median_gap(times: list[float]) -> float:
    """Median time between consecutive steps (a run's steady-state seconds per step)."""
    return statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def report(path: str | Path, label: str, columns: dict[str, str], rows: list[dict], **extra) -> None:
    """Print ``rows`` as a table (``label`` column first, then ``columns``: heading -> row key) and write
    them with the command line, the CPU and ``extra`` to ``path``."""
    import os
    import sys

    width = max(9, *(len(h) + 1 for h in columns))
    print(f"{label:<11} " + " ".join(f"{h:>{width}}" for h in columns))
    for r in rows:
        print(f"{r[label]:<11} " + " ".join(f"{r[k]:>{width}}" for k in columns.values()))
    command = f"python benchmarks/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:])
    out = {"command": command.rstrip(), "cpu": cpu_model(), "cpus": os.cpu_count(), **extra, "rows": rows}
    write_results(path, out)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``): results differ between the Xeons and EPYCs this runs on."""
    import platform

    from asyncrl.numerics import cpu_info

    return cpu_info()["model"] or platform.processor() or platform.machine()


def stamped(benchmark: str, **fields) -> dict:
    """What a GPU benchmark's JSON starts with: its name, the command line and the date, then ``fields``."""
    import sys

    return {
        "benchmark": benchmark,
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        **fields,
    }


def rounds(arms: list, repeats: int):
    """(round, arm): every arm once per round, the order rotating, so that no arm always runs first (on a GPU
    that has just idled) or last."""
    for r in range(repeats):
        k = r % len(arms)
        for arm in arms[k:] + arms[:k]:
            yield r, arm


def write_results(path: str | Path, out: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # renamed over: a run killed mid-write leaves the last whole file
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
