"""Time the test suite and append a row to benchmarks/results/suite_times.csv, so a slower suite shows per
commit.

    python benchmarks/suite_time.py [--log FILE] [-- PYTEST_ARGS...]  # default: make test's pytest arguments
    python benchmarks/suite_time.py --from-log LOG --seconds S  # a row from a run timed elsewhere
    python benchmarks/suite_time.py --gauge  # this machine's speed now

A row: the commit (``-dirty`` when the tree has changes), the UTC date, the CPU model, the suite's wall
seconds, and the counts of passed, failed and skipped tests as pytest's last line gives them. The pytest
output (with its ``--durations`` table of the slowest tests) goes to ``--log`` as well as to the terminal.

``--gauge`` prints two fixed workloads' times, to run before and after a timed suite: a shared machine's speed
moves by a fifth within an hour (``suite_times.csv``), so two rows compare only where the gauge held. The import
of torch and transformers is what the suite's processes spend much of their CPU on, and it tracks the suite's
speed; a chained SHA-256 loop, CPU alone, does not (1.45 s -> 1.13 s over a CI run whose import went 4.20 s ->
5.29 s).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import re
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "benchmarks" / "results" / "suite_times.csv"
MAKE_TEST = ["-q", "-n", "4", "--dist", "loadfile", "--no-loadscope-reorder"]  # the Makefile's test target
FIELDS = ["commit", "date_utc", "cpu", "seconds", "passed", "failed", "skipped", "command"]


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


IMPORT = "import torch, transformers; from transformers import AutoModelForCausalLM"


def gauge(repeats: int = 3, sha_rounds: int = 3_000_000, statement: str = IMPORT) -> dict[str, float]:
    """Median wall seconds of ``repeats`` fresh interpreters running ``statement`` (importing torch and
    transformers), and CPU seconds of ``sha_rounds`` chained SHA-256 digests."""
    imports = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", statement], check=True)
        imports.append(time.perf_counter() - start)
    start, digest = time.process_time(), b"x"
    for _ in range(sha_rounds):
        digest = hashlib.sha256(digest).digest()
    return {"import_s": statistics.median(imports), "sha256_s": time.process_time() - start}


def counts(output: str) -> dict[str, int]:
    """``{"passed": n, "failed": n, "skipped": n}`` from pytest's summary line (errors count as failed)."""
    last = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    found = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}
    return {
        "passed": found.get("passed", 0),
        "failed": found.get("failed", 0) + found.get("error", 0) + found.get("errors", 0),
        "skipped": found.get("skipped", 0),
    }


def append_row(row: dict) -> None:
    new = not CSV.exists()
    with CSV.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")  # the file's own line ends
        if new:
            writer.writeheader()
        writer.writerow(row)


def run_suite(pytest_args: list[str], log: Path | None) -> tuple[float, str, int]:
    """Run pytest, echoing its output (and writing it to ``log``); returns wall seconds, output and exit
    code."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *pytest_args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    code = proc.wait()
    output = "".join(lines)
    if log:
        log.write_text(output)
    return time.monotonic() - start, output, code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", type=Path, help="also write pytest's output here")
    ap.add_argument("--from-log", type=Path, help="take the counts from this pytest output instead of running")
    ap.add_argument("--seconds", type=float, help="with --from-log: the suite's wall time")
    ap.add_argument("--commit", help="with --from-log: the commit it ran (default: HEAD)")
    ap.add_argument("--gauge", action="store_true", help="print this machine's speed (gauge()) and exit")
    ap.add_argument(
        "pytest_args",
        nargs="*",
        default=MAKE_TEST,
        help=f"after --: pytest arguments (default: {' '.join(MAKE_TEST)})",
    )
    a = ap.parse_args()
    if a.gauge:
        g = gauge()
        print(f"gauge: torch and transformers import {g['import_s']:.2f} s, SHA-256 loop {g['sha256_s']:.2f} s")
        return 0
    if a.from_log:
        if a.seconds is None:
            ap.error("--from-log needs --seconds")
        seconds, output, code, command = a.seconds, a.from_log.read_text(), 0, f"(from {a.from_log.name})"
    else:
        seconds, output, code = run_suite(a.pytest_args, a.log)
        command = " ".join(["pytest", *a.pytest_args])
    row = {
        "commit": a.commit or commit(),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "cpu": cpu_model(),
        "seconds": round(seconds),
        **counts(output),
        "command": command,
    }
    append_row(row)
    print(f"appended to {CSV}: {row}")
    return code


if __name__ == "__main__":
    sys.exit(main())
