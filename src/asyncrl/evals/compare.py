"""``python -m asyncrl.evals.compare DIR...``: eval metrics side by side (e.g. after SFT and after RL)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(dirs: list[str]) -> int:
    runs = [(Path(d).name, json.loads((Path(d) / "metrics.json").read_text())) for d in dirs]
    keys = [k for k in runs[0][1] if isinstance(runs[0][1][k], float) and "/" in k and k.count("/") == 1]
    width = max(len(k) for k in keys)
    print(f"{'metric':<{width}}  " + "  ".join(f"{name:>10}" for name, _ in runs))
    for k in keys:
        print(f"{k:<{width}}  " + "  ".join(f"{m.get(k, float('nan')):>10.4f}" for _, m in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
