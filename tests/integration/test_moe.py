"""A mixture of experts trains under FSDP2 (two CPU processes, gloo): its experts and router learn, and each
policy is handed off in the checkpoint layout (one tensor per expert) that the sidecars load; `asyncrl rl`
carries the sidecar's routes to the trainer, which replays them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file

from helpers.launch import MICRO_MOE, SMALL_TASK, asyncrl
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
    assert all(
        math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in trainer_metrics(tmp_path)
    )
    start, end = (
        load_file(str(d / "model.safetensors")) for d in (micro_moe, tmp_path / "weights" / "step_2")
    )
    assert start.keys() == end.keys()
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.up_proj.weight"):
        assert not (start[name] == end[name]).all(), name  # router and experts both trained


@pytest.fixture(scope="module")
def moe_data(micro_moe, tmp_path_factory):
    """The task's data (``asyncrl prepare``; the model is the session's micro MoE)."""
    root = tmp_path_factory.mktemp("moe_data")
    asyncrl(
        "prepare", f"data_dir={root}", *SMALL_TASK, *MICRO_MOE, f"model.name={root / 'unused'}", check=True
    )
    return root


@pytest.mark.parametrize("replay", [True, False])
def test_rl_with_routed_experts(micro_moe, moe_data, tmp_path, replay):
    """`asyncrl rl` on the micro MoE, the built-in sidecar returning each token's experts: with router replay
    the trainer routes every token as the sidecar did (no token differs); without, it measures how many
    do."""
    run = tmp_path / "rl"
    proc = asyncrl(
        "rl",
        f"data_dir={moe_data}",
        *SMALL_TASK,
        f"model.name={micro_moe}",
        f"run_dir={run}",
        "max_steps=2",
        "seq_len=128",
        "orchestrator.max_tokens=8",
        "orchestrator.prompts_per_step=4",
        "orchestrator.group_size=4",
        "orchestrator.drop_zero_advantage=false",
        "orchestrator.routed_experts=true",
        f"trainer.router_replay={str(replay).lower()}",
        "launcher.progress=false",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    mb = load_numpy(str(run / "rollouts" / "step_1" / "mb_0.safetensors"))
    routes = mb["routed_experts"]
    assert routes.dtype == np.int16 and routes.shape == (*mb["input_ids"].shape, 2, 2)
    # each trained token's logprob comes from the forward of the token before it: that one has its experts
    assert (routes[:, :-1][mb["loss_mask"][:, 1:]] >= 0).all() and routes.max() < 4
    train = trainer_metrics(run)
    assert len(train) == 2
    for row in train:
        assert 0 <= row["train/moe_router_disagrees"] <= 1
        if replay:
            assert row["train/moe_routes_differ"] == 0
        else:
            assert row["train/moe_routes_differ"] == row["train/moe_router_disagrees"]
