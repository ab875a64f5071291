"""Metric curves for DVC plots: chosen keys of a run's ``metrics/*.jsonl`` as one CSV, one row per step.

DVC plots read CSV/JSON/TSV/YAML, not JSONL, and a DVC out must hash the same on a rerun. So only the
keys named are written, and the caller names deterministic ones (``rollout/reward_mean``,
``train/loss``, ...), never the wall-clock ones (``time``, ``*/tokens_per_s``, ``time/*``) that differ
between two runs of the same seed. A key is looked up in every JSONL file of the directory; one logged
by several processes (``async/staleness``) is named with its file as ``trainer:async/staleness``.

    asyncrl curves <run_dir>/metrics <out.csv> KEY [PROCESS:KEY ...]
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncrl.monitor import read_jsonl
from asyncrl.utils.atomic import write_text_atomic


def load_metrics(metrics_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Rows of every ``<process>.jsonl`` in ``metrics_dir``, by process name."""
    files = sorted(metrics_dir.glob("*.jsonl")) if metrics_dir.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no metrics files (*.jsonl) in {metrics_dir}")
    return {f.stem: read_jsonl(f) for f in files}


def _source(sources: Mapping[str, list[dict[str, Any]]], key: str) -> tuple[str, str]:
    """``(process, metric)`` that the column ``key`` reads; ValueError naming the key if none or several."""
    process, sep, metric = key.partition(":")
    if sep:
        if process not in sources:
            raise ValueError(f"curve key {key!r}: no {process}.jsonl (have: {sorted(sources)})")
        if not any(metric in row for row in sources[process]):
            raise ValueError(f"curve key {key!r}: {process}.jsonl never logs {metric!r}")
        return process, metric
    found = [p for p, rows in sources.items() if any(key in row for row in rows)]
    if not found:
        known = sorted({k for rows in sources.values() for row in rows for k in row} - {"step"})
        raise ValueError(f"curve key {key!r} is in none of {sorted(sources)}; logged keys: {known}")
    if len(found) > 1:
        raise ValueError(f"curve key {key!r} is logged by {found}; name one, e.g. {found[0]}:{key}")
    return found[0], key


def curve_rows(sources: Mapping[str, list[dict[str, Any]]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """One dict per step (sorted) with ``step`` and each of ``keys``; a step where a key's process logged
    nothing gets ``None``. ``sources`` maps a process name to its metric rows (each with ``step``)."""
    if not keys:
        raise ValueError("name at least one curve key")
    by_step: dict[int, dict[str, Any]] = {}
    for key in keys:
        process, metric = _source(sources, key)
        for row in sources[process]:
            if metric in row:
                by_step.setdefault(int(row["step"]), {})[key] = row[metric]
    return [{"step": step, **{k: by_step[step].get(k) for k in keys}} for step in sorted(by_step)]


def to_csv(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """CSV text; floats in their shortest round-trip form, so equal values give equal bytes."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl curves",
        description="write chosen metric curves of a run (its metrics/*.jsonl) as one CSV, one row per "
        "step, "
        "for `dvc plots`; name deterministic keys only (not time or throughput), so a rerun hashes the same",
    )
    p.add_argument("metrics_dir", type=Path, help="a run's metrics directory, e.g. <run_dir>/metrics")
    p.add_argument("out", type=Path, help="the CSV to write (atomically)")
    p.add_argument(
        "keys",
        nargs="+",
        metavar="KEY",
        help="metric keys, e.g. rollout/reward_mean; PROCESS:KEY (trainer:async/staleness) for a key that "
        "several processes log",
    )
    return p


def cli(argv: list[str]) -> int:
    """``asyncrl curves METRICS_DIR OUT.csv KEY...``."""
    args = build_parser().parse_args(argv)
    try:
        rows = curve_rows(load_metrics(args.metrics_dir), args.keys)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_text_atomic(args.out, to_csv(rows, ["step", *args.keys]))
    print(f"{len(rows)} steps x {len(args.keys)} curves -> {args.out}")
    return 0
