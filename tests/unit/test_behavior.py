"""``trainer.behavior_kl``'s kept policies: a step's samples scored under the policy that sampled them."""

from __future__ import annotations

import pytest
import torch

from asyncrl.trainer.behavior import BehaviorPolicies
from asyncrl.trainer.loss import mismatch_kl_sum


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with torch.no_grad():  # bf16-representable fp32 masters, as a freshly loaded bf16 checkpoint gives
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return model


def test_a_kept_policy_computes_its_own_outputs_and_the_live_weights_come_back():
    model, x = _model(), torch.randn(5, 8)
    kept = BehaviorPolicies(model, keep=2)
    before = model(x).detach()
    kept.snapshot(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for version in (1, 2):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        kept.snapshot(version)
    after = model(x).detach()
    assert not torch.equal(after, before)
    assert sorted(kept.kept) == [1, 2]  # the oldest is dropped beyond `keep`
    with kept.swapped(1):
        one = model(x).detach()
    assert torch.equal(model(x).detach(), after)  # restored bit for bit
    assert not torch.equal(one, after)
    with pytest.raises(RuntimeError), kept.swapped(2):  # restored on error too
        raise RuntimeError("boom")
    assert torch.equal(model(x).detach(), after)


def test_the_snapshot_is_exact_for_bf16_representable_weights():
    model, x = _model(), torch.randn(5, 8)
    kept = BehaviorPolicies(model, keep=1)
    before = model(x).detach()
    kept.snapshot(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    with kept.swapped(3):
        assert torch.equal(model(x).detach(), before)
    assert BehaviorPolicies(model, keep=0).kept == {}


def test_mismatch_kl_sum_is_zero_for_equal_logprobs_and_counts_masked_tokens_only():
    lp = torch.log(torch.tensor([[0.2, 0.5, 0.9]]))
    assert mismatch_kl_sum(lp, lp.clone(), torch.ones(1, 3)) == 0.0
    other = lp + torch.tensor([[0.0, 0.3, 0.0]])
    r = torch.exp(torch.tensor(0.3))
    assert mismatch_kl_sum(other, lp, torch.tensor([[1, 1, 0]])) == pytest.approx(float(r - 0.3 - 1))
    assert mismatch_kl_sum(other, lp, torch.tensor([[1, 0, 1]])) == 0.0


def test_under_fsdp2_the_kept_policy_and_the_live_one_are_what_the_forwards_see():
    # FSDP2 keeps the root and a unit with reshard_after_forward=False gathered after a forward: a swap must
    # not leave the next forward on the gathered copy of the other policy (the trainer's layout:
    # trainer/parallel.py)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from asyncrl.utils.process import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model, x = _model(), torch.randn(5, 8)
        # gathered copies apart from the shards, as in bf16-mixed
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        fully_shard(model[0], mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model[2], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        kept = BehaviorPolicies(model, keep=1)  # both before any forward, as the trainer builds them: the
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # parameters are the shards then
        old = model(x).detach()
        kept.snapshot(0)
        model(x).square().sum().backward()
        opt.step()
        live = model(x).detach()  # leaves the root and model[2] gathered, with the live weights
        assert not torch.equal(live, old)
        with kept.swapped(0):
            assert torch.equal(model(x).detach(), old)
        assert torch.equal(model(x).detach(), live)
    finally:
        dist.destroy_process_group()
