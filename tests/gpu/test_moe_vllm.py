"""A mixture of experts (Qwen3-MoE, tests/gpu/conftest.py's GPU_MOE) served by vLLM: RL with every policy
reaching vLLM's experts over files, NCCL and CUDA IPC, and router replay of the experts vLLM routed each
token to. Run: pytest -m gpu tests/gpu/test_moe_vllm.py (vLLM's MoE kernels: carry .vllm-moe, made by
benchmarks/device_moe_kernels.sh)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file as load_numpy

from gpu.conftest import record
from gpu.test_gpu import rl_with_vllm

pytestmark = pytest.mark.gpu

# on-policy (async_level 0) the trainer and vLLM hold the same weights at every step, so mismatch_kl is bf16
# noise (the dense model's is ~1e-3 at step 0; a token routed to other experts by a bf16 near-tie adds to
# it); a sidecar whose experts missed an update lags the trainer by one lr=1e-3 step, which moves it more
BF16_MISMATCH = 1e-2
ON_POLICY = ["async_level=0", "trainer.optim.lr=1e-3"]


def mismatch_per_step(name: str, orch: list[dict], train: list[dict], steps: int) -> list[float]:
    """Each step's train/mismatch_kl (recorded as ``name``), after checking that every policy was loaded in
    turn."""
    mismatch = [r["train/mismatch_kl"] for r in train]
    record(f"{name}_mismatch_kl_per_step", mismatch)
    record(f"{name}_update_weights_s", [r["time/update_weights_s"] for r in orch[1:]])
    assert [r["async/policy_version"] for r in orch] == list(range(steps))
    return mismatch


def test_rl_moe_with_vllm_over_files(gpu_moe_setup, tmp_path):
    """weights/step_N holds one tensor per expert (the checkpoint layout), which vLLM reloads in place each
    step."""
    run = tmp_path / "rl"
    orch, train = rl_with_vllm(gpu_moe_setup, run, "max_steps=6", *ON_POLICY)
    mismatch = mismatch_per_step("moe_files", orch, train, 6)
    record("moe_files_rewards", [round(r["rollout/reward_mean"], 4) for r in orch])
    assert mismatch[0] < BF16_MISMATCH and max(mismatch) < BF16_MISMATCH, mismatch


@pytest.mark.parametrize("reload", ["direct", "layerwise"])
def test_rl_moe_ipc_transport_one_gpu(gpu_moe_setup, tmp_path, reload):
    """weights.transport=ipc: the fused experts (two tensors a layer) are copied from the trainer's buffer
    into vLLM's; a direct load checks that every parameter of vLLM's model was written, its experts
    included."""
    run = tmp_path / "rl"
    orch, train = rl_with_vllm(
        gpu_moe_setup, run, "max_steps=6", *ON_POLICY, "weights.transport=ipc", f"weights.reload={reload}"
    )
    mismatch = mismatch_per_step(f"moe_ipc_{reload}", orch, train, 6)
    assert max(mismatch) < BF16_MISMATCH, mismatch
    assert not list((run / "weights").glob("step_[1-5]/*.safetensors"))  # 1-5 went through the buffer


@pytest.mark.two_gpus
def test_rl_moe_nccl_transport_two_gpus(gpu_moe_setup, tmp_path):
    """weights.transport=nccl: the trainer (GPU 1) broadcasts the fused experts into vLLM (GPU 0)."""
    run = tmp_path / "rl"
    orch, train = rl_with_vllm(
        gpu_moe_setup,
        run,
        "max_steps=6",
        *ON_POLICY,
        "weights.transport=nccl",
        "inference.gpus=['0']",
        "trainer.fabric.gpus=1",
    )
    mismatch = mismatch_per_step("moe_nccl", orch, train, 6)
    assert max(mismatch) < BF16_MISMATCH, mismatch
    assert not list((run / "weights").glob("step_[1-5]/*.safetensors"))  # 1-5 went over NCCL
    assert list((run / "weights").glob("step_6/*.safetensors"))


@pytest.mark.parametrize("replay", [True, False])
def test_router_replay_with_vllms_routes(gpu_moe_setup, tmp_path, replay):
    """vLLM answers the experts it routed each token to; replayed, the trainer uses exactly those (no token's
    experts differ); not replayed, its own bf16 router picks others for some tokens (recorded: how many)."""
    run = tmp_path / "rl"
    flag = str(replay).lower()
    orch, train = rl_with_vllm(
        gpu_moe_setup,
        run,
        "max_steps=3",
        *ON_POLICY,
        "orchestrator.routed_experts=true",
        f"trainer.router_replay={flag}",
    )
    mb = load_numpy(str(run / "rollouts" / "step_1" / "mb_0.safetensors"))
    routes = mb["routed_experts"]
    # each trained token's logprob comes from the forward of the token before it: vLLM answered that one's
    # experts
    assert routes.shape == (*mb["input_ids"].shape, 4, 2) and routes.dtype == np.int16
    assert (routes[:, :-1][mb["loss_mask"][:, 1:]] >= 0).all() and routes.max() < 8
    differ = [r["train/moe_routes_differ"] for r in train]
    disagrees = [r["train/moe_router_disagrees"] for r in train]
    record(f"moe_replay_{flag}_routes_differ", differ)
    record(f"moe_replay_{flag}_router_disagrees", disagrees)
    record(f"moe_replay_{flag}_mismatch_kl", [r["train/mismatch_kl"] for r in train])
    if replay:
        assert differ == [0.0] * 3
    else:
        assert differ == disagrees and max(differ) > 0


@pytest.mark.parametrize("replay, temperature", [(False, 1.0), (True, 0.7)])
def test_bitwise_mode_for_the_mixture_of_experts(gpu_moe_setup, tmp_path, replay, temperature):
    """numerics=bitwise on the MoE: the trainer's router and experts are vLLM's kernels
    (asyncrl.models.vllm_moe) and its logprobs those of vLLM's V1 model runner (the one vLLM serves a mixture
    of experts with), so the trainer's router picks vLLM's experts for every token and on-policy mismatch_kl
    is exactly 0, with router replay too; at a temperature other than 1, where V1's sampler and V2's round
    differently."""
    flag = str(replay).lower()
    _, train = rl_with_vllm(
        gpu_moe_setup, tmp_path / "rl", "numerics=bitwise", "max_steps=3", *ON_POLICY,
        "orchestrator.routed_experts=true", f"trainer.router_replay={flag}", "trainer.behavior_kl=true",
        f"orchestrator.temperature={temperature}",
    )  # fmt: skip
    mismatch = [r["train/mismatch_kl"] for r in train]
    disagrees = [r["train/moe_router_disagrees"] for r in train]
    record(f"moe_bitwise_replay_{flag}_mismatch_kl", mismatch)
    record(f"moe_bitwise_replay_{flag}_router_disagrees", disagrees)
    record(f"moe_bitwise_replay_{flag}_behavior_kl", [r["train/behavior_kl"] for r in train])
    assert disagrees == [0.0] * 3
    assert mismatch == [0.0] * 3
