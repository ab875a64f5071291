"""The trainer alone, without sidecar or orchestrator: synthetic rollouts on disk, and the overrides and
metrics that the sharding tests (FSDP2 on two processes, two torchrun "nodes", two GPUs) compare with one
process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from asyncrl.rollouts.packing import Sample, pack_samples
from asyncrl.transport.rollouts import write_rollouts

# what must match between a sharded run and one process, step by step; grad_norm catches a gradient that is
# averaged over ranks instead of summed (Adam would hide it in the loss)
COMPARED = ("train/loss", "train/grad_norm", "train/mismatch_kl")


def write_synthetic_rollouts(run_dir: Path, steps: int, ranks: int, one_per_row: bool = False) -> None:
    """Random packed rollouts, recorded as on-policy, so the trainer runs without an orchestrator
    (``one_per_row``: each sample alone in its row, as context parallelism packs them)."""
    rng = np.random.default_rng(0)
    for step in range(steps):
        samples = []
        for _ in range(24):
            completion = rng.integers(6, 30, rng.integers(2, 9)).tolist()
            samples.append(
                Sample(
                    rng.integers(6, 30, rng.integers(3, 8)).tolist(),
                    completion,
                    (-rng.random(len(completion)) * 3).tolist(),
                    float(rng.normal()),
                    1.0,
                )
            )
        mbs = pack_samples(
            samples,
            64,
            0,
            rows_per_micro_batch=2,
            multiple_of=ranks,
            pad_multiple=16,
            one_per_row=one_per_row,
        )
        write_rollouts(
            run_dir / "rollouts" / f"step_{step}",
            mbs,
            {
                "step": step,
                "policy_versions": [step],
                "num_samples": len(samples),
                "loss_tokens": int(sum(m["loss_mask"].sum() for m in mbs)),
            },
        )


def trainer_only_args(model: Path, steps: int = 3) -> list[str]:
    """Overrides of a short trainer run on synthetic rollouts (on-policy, so no step waits for a policy),
    with gradient clipping active: the norms (~0.3) must be the same global ones in every layout."""
    return [
        f"model.name={model}",
        f"max_steps={steps}",
        "async_level=0",
        "strict_async=false",
        "seq_len=64",
        "orchestrator.max_tokens=16",
        "trainer.optim.lr=1e-3",
        "trainer.optim.max_grad_norm=0.1",
    ]


def trainer_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
