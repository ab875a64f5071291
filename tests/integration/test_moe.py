"""A mixture of experts trains under FSDP2 (two CPU processes, gloo): its experts and router learn, and each policy is
handed off in the checkpoint layout (one tensor per expert) that the sidecars load."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from helpers.launch import asyncrl
from helpers.synthetic import trainer_metrics, trainer_only_args, write_synthetic_rollouts

pytestmark = pytest.mark.slow


def test_moe_trains_under_fsdp2(micro_moe, tmp_path):
    write_synthetic_rollouts(tmp_path, steps=2, ranks=2)
    proc = asyncrl(
        "train",
        *trainer_only_args(micro_moe, steps=2),
        f"run_dir={tmp_path}",
        "trainer.fabric.strategy=fsdp2",
        "trainer.fabric.devices=2",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in trainer_metrics(tmp_path))
    start, end = (load_file(str(d / "model.safetensors")) for d in (micro_moe, tmp_path / "weights" / "step_2"))
    assert start.keys() == end.keys()
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.up_proj.weight"):
        assert not (start[name] == end[name]).all(), name  # router and experts both trained
