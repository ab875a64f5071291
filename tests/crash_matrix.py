"""The randomized kill -9 matrix: run it before resolving anything that touches resume.

    python tests/crash_matrix.py --trials 16 --seed 0 [--out crash_matrix.json]

Builds the test suite's setup (micro model, data, 100-step SFT) in a temporary directory, runs a straight
RL run of ``--max-steps`` steps checkpointing every ``--interval``, then ``--trials`` trials: each kills a
random process (inference, orchestrator, trainer, launcher) with SIGKILL after a random trainer step past
the first checkpoint plus a random delay (so kills land mid-step, mid-checkpoint, mid-publish), resumes
with ``ckpt.resume=latest`` and compares with the straight run (tests/helpers/crash.py). Prints one line per
trial and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from helpers.crash import TARGETS, Trial, crash_and_resume  # noqa: E402
from helpers.launch import asyncrl, make_setup, rl_args  # noqa: E402 -- after the path insert


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=12)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="write the trials as JSON here")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    root = Path(tempfile.mkdtemp(prefix="crash-matrix-"))
    print(f"setup in {root}", flush=True)
    setup = make_setup(root / "setup")
    # launcher.max_restarts=0: a killed sidecar stops the run, which is what a trial checks
    extra = (f"max_steps={a.max_steps}", f"ckpt.interval={a.interval}", "launcher.max_restarts=0")
    straight = root / "straight"
    asyncrl("rl", *rl_args(setup, straight, *extra), check=True, timeout=600)
    trials, start = [], time.monotonic()
    for i in range(a.trials):
        trial = Trial(
            rng.choice(TARGETS), rng.randrange(a.interval, a.max_steps - 1), round(rng.uniform(0, 0.6), 2)
        )
        run = root / f"trial{i}"
        crash_and_resume(rl_args(setup, run, *extra), run, straight, trial, a.max_steps)
        trials.append(trial)
        verdict = "ok" if not trial.problems else "FAILED: " + trial.problems[0].splitlines()[0]
        print(
            f"trial {i:2d}: kill {trial.target:12s} after step {trial.after_step:2d} +{trial.delay_s:.2f}s "
            f"(landed at {trial.killed_at}), resumed from {trial.resumed_from or '-'}: {verdict}",
            flush=True,
        )
    failed = [t for t in trials if t.problems]
    print(
        f"{len(trials) - len(failed)}/{len(trials)} trials passed in "
        f"{time.monotonic() - start:.0f} s (seed {a.seed})"
    )
    if a.out:
        a.out.write_text(
            json.dumps(
                {
                    "seed": a.seed,
                    "max_steps": a.max_steps,
                    "interval": a.interval,
                    "trials": [asdict(t) for t in trials],
                },
                indent=2,
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
