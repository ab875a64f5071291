"""Nucleus sampling end to end on the built-in CPU engine: at step 0 (the same weights on both sides) the
trainer's logprobs match the sidecar's when it scores the truncated distribution, and are off by the log of
the kept mass when it scores the full one (trainer.loss.truncated_logprobs=false)."""

from __future__ import annotations

import pytest

from helpers.launch import asyncrl, rl_args
from helpers.metrics import read_jsonl

pytestmark = pytest.mark.slow


def _step_0(setup, run, *extra: str) -> dict:
    # one step of 8 prompts x 8 samples: the mismatch is a per-token mean, a few hundred tokens measure it
    args = [
        a for a in rl_args(setup, run, "max_steps=1") if not a.startswith("orchestrator.prompts_per_step=")
    ]
    args = [a for a in args if not a.startswith("orchestrator.group_size=")]
    proc = asyncrl("rl", *args, "orchestrator.prompts_per_step=8", "orchestrator.group_size=8", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(run / "metrics" / "trainer.jsonl")[0]


def test_top_p_ratios_are_exact_when_the_trainer_scores_the_truncated_distribution(setup, tmp_path):
    exact = _step_0(setup, tmp_path / "exact", "orchestrator.top_p=0.9")
    biased = _step_0(
        setup, tmp_path / "biased", "orchestrator.top_p=0.9", "trainer.loss.truncated_logprobs=false"
    )
    # the CPU engine and the trainer share their numerics: what is left is rounding
    assert exact["train/mismatch_kl"] < 1e-6, exact
    assert exact["train/truncation_outside_frac"] < 0.01, exact
    # scored under the full distribution, every token's ratio is off by its kept mass (log 0.9 or less)
    assert biased["train/mismatch_kl"] > 100 * max(exact["train/mismatch_kl"], 1e-8), biased
    assert biased["train/ratio_mean"] < 1 and "train/truncation_outside_frac" not in biased
