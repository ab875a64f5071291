"""kill -9 of each process of an `asyncrl rl` run between checkpoints, then `ckpt.resume=latest`: the run
ends as a straight one would, bit for bit, and no process is left behind (one trial per process here;
`python tests/crash_matrix.py` runs many at random steps and moments)."""

from __future__ import annotations

import pytest

from helpers.crash import Trial, crash_and_resume
from helpers.launch import rl_args

pytestmark = pytest.mark.slow


# checkpoints at 4 and 8 of 8 steps: each kill lands after step 4's, at a different step. The launcher's
# trial starts its processes as fresh interpreters (launcher.preload=false), the others as forks of the
# launcher: both ways must end as the straight run (forked) does, bit for bit, and leave nothing behind
@pytest.mark.parametrize(
    "target,after_step,preload",
    [("inference", 5, True), ("orchestrator", 4, True), ("trainer", 6, True), ("launcher", 5, False)],
)
def test_kill_9_then_resume_ends_like_a_straight_run(setup, straight, tmp_path, target, after_step, preload):
    run = tmp_path / "rl"
    trial = crash_and_resume(
        # launcher.max_restarts=0: a dead sidecar stops the run here (test_continuous.py has it restarted)
        rl_args(
            setup,
            run,
            "max_steps=8",
            "ckpt.interval=4",
            "launcher.max_restarts=0",
            f"launcher.preload={preload}",
        ),
        run,
        straight,
        Trial(target, after_step),
        max_steps=8,
    )
    assert not trial.problems, "\n".join(trial.problems)
    assert trial.resumed_from.startswith("checkpoint step 4"), trial.resumed_from
