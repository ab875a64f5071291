"""Whether one eval beats another beyond the noise: their sampled rewards compared task by task.

    python experiments/paired.py outputs/agent_adder/eval_sft outputs/agent_adder/eval_rl

Reads each dir's ``samples.jsonl`` (``asyncrl eval``, ``mode: sampled``) and pairs the two by task id: the
difference of each task's mean sampled reward (second minus first), its mean over the tasks both evals hold,
the standard error of that mean, a 95% interval from 10,000 bootstrap resamples of the tasks (seeded, so the
same files print the same), and how many tasks went up, down or stayed. Pairing by task removes the spread
between tasks (some sums are harder), which an unpaired comparison of the two means counts as noise."""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RESAMPLES = 10_000


def task_means(eval_dir: Path) -> dict[str, float]:
    """Each task's mean reward over its sampled episodes."""
    rewards: dict[str, list[float]] = defaultdict(list)
    with (eval_dir / "samples.jsonl").open() as f:
        for line in f:
            sample = json.loads(line)
            if sample.get("mode") == "sampled":
                rewards[sample["id"]].append(float(sample["reward"]))
    return {task: statistics.fmean(r) for task, r in rewards.items()}


def paired(before: dict[str, float], after: dict[str, float], seed: int = 0) -> dict[str, float]:
    """The per-task differences ``after - before`` summed up (see the module doc)."""
    tasks = sorted(before.keys() & after.keys())
    if len(tasks) < 2:
        raise SystemExit(f"{len(tasks)} task(s) in both evals: nothing to pair")
    diffs = [after[t] - before[t] for t in tasks]
    rng = random.Random(seed)
    boot = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(RESAMPLES))
    return {
        "tasks": len(tasks),
        "before": statistics.fmean(before[t] for t in tasks),
        "after": statistics.fmean(after[t] for t in tasks),
        "diff": statistics.fmean(diffs),
        "se": statistics.stdev(diffs) / len(diffs) ** 0.5,
        "ci_low": boot[int(0.025 * RESAMPLES)],
        "ci_high": boot[int(0.975 * RESAMPLES) - 1],
        "up": sum(d > 0 for d in diffs),
        "down": sum(d < 0 for d in diffs),
        "same": sum(d == 0 for d in diffs),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    first, second = (Path(a) for a in argv)
    s = paired(task_means(first), task_means(second))
    print(
        f"{s['tasks']} tasks: sampled reward {s['before']:.3f} ({first}) -> {s['after']:.3f} ({second}); "
        f"difference {s['diff']:+.3f}, standard error {s['se']:.3f} ({s['diff'] / s['se']:.1f} SE), "
        f"95% bootstrap interval [{s['ci_low']:+.3f}, {s['ci_high']:+.3f}]; "
        f"tasks up {s['up']}, down {s['down']}, same {s['same']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
