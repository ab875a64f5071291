"""What the trainer's step hands its model and loss: the forward's outputs in the dtype they were computed
in, and micro-batches moved with their attention boundaries computed on the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.config.trainer import FabricConfig
from asyncrl.models import attention
from asyncrl.models.logprobs import compute_logprobs
from asyncrl.trainer.forward import PACKED_KWARGS, micro_batch_to_device
from asyncrl.trainer.state import build_fabric


def test_bf16_mixed_keeps_the_logits_in_bf16_and_the_logprobs_are_unchanged():
    """Fabric's own bf16-mixed plugin casts the forward's outputs to fp32: the whole [T, vocab] logits, 10 GB
    at 16k tokens and a 152k vocabulary, every micro-batch. The trainer's keeps them bf16, and the logprobs
    (which upcast themselves) are the same numbers, bit for bit."""
    fabric = build_fabric(dataclasses.replace(FabricConfig(), precision="bf16-mixed"))
    torch.manual_seed(0)
    head = fabric.setup_module(torch.nn.Linear(16, 50))
    x, ids, temps = torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7)), torch.full((2, 7), 0.7)
    logits = head(x)
    assert logits.dtype == torch.bfloat16  # Fabric's MixedPrecision would give float32 here
    logprobs = compute_logprobs(logits, ids, temps)
    assert logprobs.dtype == torch.float32
    # what the fp32 cast gave before
    assert torch.equal(logprobs, compute_logprobs(logits.float(), ids, temps))
    fabric.backward(logprobs.sum())  # the gradient reaches the fp32 master weights through the bf16 logits
    assert head.weight.grad is not None and head.weight.grad.dtype == torch.float32


def test_32_true_is_fabrics_own_precision():
    fabric = build_fabric(FabricConfig())
    assert fabric.setup_module(torch.nn.Linear(4, 3))(torch.randn(2, 4)).dtype == torch.float32


def test_a_micro_batch_moves_with_its_boundaries_computed_on_the_host():
    """``micro_batch_to_device`` gives every tensor (same values) and the packed attention kwargs of its
    rows, equal to computing them from the moved ``position_ids``, which on a GPU costs two host syncs a
    forward."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 0]])
    mb = {"input_ids": torch.arange(18).view(2, 9), "position_ids": positions, "loss_mask": positions > 0}
    moved = micro_batch_to_device(mb, torch.device("cpu"))
    assert set(moved) == {*mb, PACKED_KWARGS}
    for k, v in mb.items():
        assert torch.equal(moved[k], v)
    kwargs, expected = moved[PACKED_KWARGS], attention.packed_kwargs(positions)
    assert kwargs.keys() == expected.keys()
    assert torch.equal(kwargs["cu_seq_lens_q"], expected["cu_seq_lens_q"])
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 9, 15, 17, 18]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 6


def test_bf16_mixed_autocasts_on_the_device_fabric_runs_on():
    """``accelerator=auto`` without a GPU runs on the CPU: autocast must be the CPU's too (a CUDA autocast
    there would do nothing, and the bf16 input cast would meet fp32 weights)."""
    if torch.cuda.is_available():
        pytest.skip("the case is a machine without CUDA")
    fabric = build_fabric(dataclasses.replace(FabricConfig(), precision="bf16-mixed", accelerator="auto"))
    out = fabric.setup_module(torch.nn.Linear(4, 3))(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16


def test_the_step_reads_the_device_once_after_the_optimizer_step_is_queued(monkeypatch):
    """The losses, the loss metrics and the gradient norm come back in one host sync after the clip and the
    optimizer step are queued (a read before either would make the GPU wait for the host to launch it), with
    the values the same step computes by hand."""
    import types

    from asyncrl.trainer.step import step_over_micro_batches

    events: list[str] = []
    for name in ("tolist", "item", "__float__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda t, *a, _o=orig, **k: events.append("read") or _o(t, *a, **k)
        )

    class Model(torch.nn.Module):
        config = types.SimpleNamespace(_attn_implementation="sdpa")

        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(40, 8), torch.nn.Linear(8, 40)

        def forward(self, input_ids, position_ids, use_cache):
            return types.SimpleNamespace(logits=self.head(self.embed(input_ids)))

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            events.append("step")
            return super().step(closure)

    import copy

    torch.manual_seed(0)
    fabric = build_fabric(FabricConfig())
    raw = Model()
    reference = copy.deepcopy(raw)
    model = fabric.setup_module(raw)
    optimizer = fabric.setup_optimizers(Recording(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    pos = torch.arange(12).repeat(2, 1)
    mbs = [
        {"input_ids": torch.randint(0, 40, (2, 12)), "position_ids": pos, "temperatures": torch.ones(2, 12)}
        for _ in range(2)
    ]

    def loss_fn(logprobs, mb):
        return -logprobs.mean() / 2, {"train/metric": logprobs.detach().sum()}

    # the same step by hand, on a copy: the values the step must report and the parameters it must leave
    total, metric = 0.0, 0.0
    for mb in mbs:
        logits = reference(mb["input_ids"], mb["position_ids"], False).logits
        loss, m = loss_fn(compute_logprobs(logits, mb["input_ids"], mb["temperatures"]), mb)
        loss.backward()
        total, metric = total + float(loss), metric + float(m["train/metric"])
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    expected = [p.detach() - 0.1 * p.grad for p in reference.parameters()]
    events.clear()
    out = step_over_micro_batches(fabric, model, optimizer, scheduler, mbs, loss_fn, max_grad_norm=1e6)
    # nothing read before the optimizer step is queued
    assert events[0] == "step" and "read" in events, events
    assert out == pytest.approx({"loss": total, "train/metric": metric, "grad_norm": norm}, rel=1e-5)
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got.detach(), want)
