"""Context parallelism on two GPUs (trainer.fabric.context_parallel=2, torch's ring attention over SDPA's
CUDA kernels): the same steps as one GPU without it, loss and gradient norm step by step. Run: pytest -m gpu
tests/gpu/test_context_parallel.py (2 GPUs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpu.conftest import record
from gpu.test_gpu import synthetic_train_args

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]


def test_context_parallel_two_gpus_matches_one(micro_model, tmp_path):
    from helpers.synthetic import write_synthetic_rollouts

    common = [*synthetic_train_args(micro_model, "fsdp2"), "model.attn_implementation=sdpa"]
    runs = {
        "one": ["trainer.fabric.devices=1", "trainer.fabric.gpus=0"],
        "cp2": [
            "trainer.fabric.devices=2",
            "trainer.fabric.gpus='0,1'",
            "trainer.fabric.context_parallel=2",
        ],
    }
    for name, extra in runs.items():
        write_synthetic_rollouts(tmp_path / name, steps=3, ranks=1, one_per_row=True)
        proc = subprocess.run(
            [sys.executable, "-m", "asyncrl", "train", *common, f"run_dir={tmp_path / name}", *extra],
            capture_output=True, text=True, timeout=600,
            env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "0,1"},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {n: [json.loads(x) for x in (tmp_path / n / "metrics" / "trainer.jsonl").read_text().splitlines()]
            for n in runs}  # fmt: skip
    for key in ("train/loss", "train/grad_norm", "train/mismatch_kl"):
        one, cp2 = ([r[key] for r in rows[n]] for n in runs)
        record(f"context_parallel_{key.split('/')[1]}", {"one": one, "cp2": cp2})
        assert cp2 == pytest.approx(one, rel=2e-2, abs=1e-3), key  # bf16, reductions in another order
