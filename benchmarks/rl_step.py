"""RL seconds per step, asynchronous (async_level=1) against synchronous (async_level=0), side by side.

Runs `asyncrl rl` on the reverse_text experiment from a given (SFT-warmed) model, alternating the two
settings for ``--repeats`` rounds so machine noise hits both alike. Per run it takes the median gap
between consecutive trainer steps (skipping warm-up steps), plus the median generation and training
times from the metrics files. Prints a table and writes JSON.

    python benchmarks/rl_step.py --model outputs/reverse_text/sft/model --steps 40 --repeats 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import median_gap, read_jsonl, write_results


def one_run(model: str, steps: int, k: int, run_dir: Path, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "rl",
        "experiment=reverse_text",
        f"model.name={model}",
        f"run_dir={run_dir}",
        f"max_steps={steps}",
        f"async_level={k}",
        "launcher.progress=false",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed:\n{proc.stderr[-3000:]}")
    train, orch = (read_jsonl(run_dir / "metrics" / f"{name}.jsonl") for name in ("trainer", "orchestrator"))
    warm = 5  # process start-up and first-step effects
    return {
        "s_per_step": median_gap([r["time"] for r in train[warm:]]),
        "generate_s": statistics.median(r["time/generate_s"] for r in orch[warm:]),
        "train_s": statistics.median(r["time/train_s"] for r in train[warm:]),
        "train_tok_s": statistics.median(r["train/tokens_per_s"] for r in train[warm:]),
        "publish_s": statistics.median(r["time/publish_s"] for r in train[warm:]),  # trainer's weight export
        "update_weights_s": statistics.median(r["time/update_weights_s"] for r in orch[warm:]),  # sidecar reload
        "gen_tok_s": statistics.median(r["rollout/throughput_tok_s"] for r in orch[warm:]),
        "reward_last10": statistics.mean(r["rollout/reward_mean"] for r in orch[-10:]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outputs/reverse_text/sft/model")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/rl_step_cpu.json")
    ap.add_argument("--run-root", default=None, help="where run directories go (e.g. /dev/shm: weights through tmpfs)")
    ap.add_argument("extra", nargs="*", help="more overrides, e.g. orchestrator.prompts_per_step=8")
    args = ap.parse_args()
    results: dict[int, list[dict]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory(dir=args.run_root) as tmp:
        for r in range(args.repeats):
            for k in (1, 0):
                results[k].append(one_run(args.model, args.steps, k, Path(tmp) / f"k{k}_{r}", args.extra))
    summary = {k: {m: statistics.median(run[m] for run in runs) for m in runs[0]} for k, runs in results.items()}
    ratio = summary[0]["s_per_step"] / summary[1]["s_per_step"]
    print(f"RL step time, reverse_text, {args.steps} steps x {args.repeats} interleaved repeats (medians)")
    print(
        f"{'async_level':>11} {'s/step':>8} {'gen s':>7} {'train s':>8} {'export s':>9} {'reload s':>9} "
        f"{'train tok/s':>12} {'gen tok/s':>10}"
    )
    for k in (0, 1):
        s = summary[k]
        print(
            f"{k:>11} {s['s_per_step']:>8.3f} {s['generate_s']:>7.3f} {s['train_s']:>8.3f} {s['publish_s']:>9.3f} "
            f"{s['update_weights_s']:>9.3f} {s['train_tok_s']:>12.0f} {s['gen_tok_s']:>10.0f}"
        )
    print(f"speed-up of async_level=1 over 0: {ratio:.2f}x")
    out = {
        "benchmark": "rl_step",
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": __import__("os").cpu_count(),
        },
        "steps": args.steps,
        "repeats": args.repeats,
        "summary": summary,
        "speedup_async1_over_0": ratio,
        "runs": results,
    }
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
