"""GPU layouts from one `asyncrl rl` command (conf/layout/, config/layout.py) on four GPUs: two vLLM
replicas, or one replica with tensor parallelism 2, beside an FSDP2 trainer over two GPUs, every policy
broadcast over NCCL bucket by bucket to every replica and every tensor-parallel worker. Run: pytest -m gpu
tests/gpu/test_layouts.py."""

from __future__ import annotations

import statistics

import pytest

from gpu.conftest import record
from gpu.test_gpu import rl_with_vllm

pytestmark = [pytest.mark.gpu, pytest.mark.four_gpus]

STEPS = 40


@pytest.mark.parametrize("layout", ["4gpu_2replicas", "4gpu_tp2"])
def test_rl_on_a_four_gpu_layout(gpu_setup, tmp_path, layout):
    """On-policy (async_level 0), so every step's mismatch_kl is the trainer against the replicas at the same
    weights: bf16 noise at step 0 and after, which holds only if each broadcast reached every worker (a
    replica left a step behind would score its samples under the previous policy). The reward rises, and with
    two replicas the orchestrator balances requests over both."""
    run = tmp_path / "rl"
    orch, train = rl_with_vllm(
        gpu_setup, run, f"layout={layout}", f"max_steps={STEPS}", "async_level=0", "trainer.optim.lr=3e-4",
        "model.attn_implementation=varlen",
    )  # fmt: skip
    rewards = [r["rollout/reward_mean"] for r in orch]
    mismatch = [r["train/mismatch_kl"] for r in train]
    updates = [r["time/update_weights_s"] for r in orch[1:]]
    served = {k: v for k, v in orch[-1].items() if k.startswith("inference/server")}
    record(f"{layout}_rewards", [round(x, 4) for x in rewards])
    record(f"{layout}_mismatch_kl", mismatch)
    record(f"{layout}_update_weights_s_median", statistics.median(updates))
    record(
        f"{layout}_publish_s_median",
        statistics.median(r["time/publish_s"] for r in train if "time/publish_s" in r),
    )
    record(f"{layout}_requests_per_server", served)
    assert [r["async/policy_version"] for r in orch] == list(range(STEPS))
    assert not list((run / "weights").glob("step_[1-9]/*.safetensors"))  # they went over NCCL
    assert mismatch[0] < 1e-3 and max(mismatch) < 1e-2, mismatch
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.01, rewards
    if layout == "4gpu_2replicas":
        assert len(served) == 2 and min(served.values()) >= 0.25 * sum(served.values()), served
