"""``asyncrl compare EVAL_DIR...``: eval metrics side by side (e.g. after SFT and after RL).

Each directory is an ``asyncrl eval`` output (``eval.out_dir``) holding ``metrics.json``; the table lists the
first one's ``section/metric`` floats, one column per directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def table(dirs: list[Path]) -> str:
    """The comparison table: one row per metric of the first directory, one column per directory."""
    runs = [(d.name, json.loads((d / "metrics.json").read_text())) for d in dirs]
    keys = [k for k in runs[0][1] if isinstance(runs[0][1][k], float) and "/" in k and k.count("/") == 1]
    width = max(len(k) for k in keys)
    lines = [f"{'metric':<{width}}  " + "  ".join(f"{name:>10}" for name, _ in runs)]
    lines += [
        f"{k:<{width}}  " + "  ".join(f"{m.get(k, float('nan')):>10.4f}" for _, m in runs) for k in keys
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl compare",
        description="print the metrics of `asyncrl eval` runs side by side, e.g. "
        "`asyncrl compare outputs/reverse_text/eval_sft outputs/reverse_text/eval_rl`",
    )
    p.add_argument(
        "dirs", nargs="+", type=Path, metavar="EVAL_DIR", help="an eval.out_dir holding metrics.json"
    )
    return p


def cli(argv: list[str]) -> int:
    """``asyncrl compare EVAL_DIR...``."""
    p = build_parser()
    args = p.parse_args(argv)
    if missing := [str(d / "metrics.json") for d in args.dirs if not (d / "metrics.json").is_file()]:
        print(f"error: no eval metrics: {', '.join(missing)} (run `asyncrl eval` first)", file=sys.stderr)
        return 2
    print(table(args.dirs))
    return 0
