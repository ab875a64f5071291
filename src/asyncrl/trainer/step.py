"""One optimizer step over a step's micro-batches: forward, backward, clip, optimizer step, and one host sync
to read the losses, the loss metrics and the gradient norm."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import record_function  # names the phases in a profile (benchmarks/trainer_mfu.py)

from asyncrl.trainer.context import ContextParallel, sharded_logprobs
from asyncrl.trainer.forward import micro_batches_to_device, packed_logprobs
from asyncrl.trainer.optim import clip_gradients


def step_over_micro_batches(
    fabric,
    model,
    optimizer,
    scheduler,
    micro_batches: list[dict[str, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict]],
    *,
    max_grad_norm: float,
    entropy_out: list | None = None,
    cp: ContextParallel | None = None,
) -> dict[str, float]:
    """Forward/backward every micro-batch (the loss is already normalised by the step's token count),
    clip, and take one optimizer step. Returns summed metrics plus ``loss`` and ``grad_norm`` (``loss_fn``'s
    metrics may be floats or 0-dim device tensors, read here in one host sync with the losses); with
    ``entropy_out``, collects the loss tokens' entropies there (see :func:`packed_logprobs`)."""
    sums: dict[str, float] = {"loss": 0.0}
    losses = []
    # metrics the loss left on the device (rl_loss's read_metrics)
    unread: list[tuple[str, torch.Tensor]] = []
    cp = cp or ContextParallel(1, fabric)
    logprobs_of = packed_logprobs if cp.mesh is None else sharded_logprobs
    for device_mb in micro_batches_to_device(micro_batches, fabric.device):
        with cp.shard(device_mb) as mb:  # forward and backward inside: ring attention runs in both
            with record_function("asyncrl.forward"):
                loss, metrics = loss_fn(logprobs_of(model, mb, entropy_out), mb)
            with record_function("asyncrl.backward"):
                # The loss is a sum over this rank's tokens divided by the whole step's token count, so the
                # step's gradient is the *sum* over ranks; DDP and FSDP average instead, hence the factor.
                fabric.backward(loss * fabric.world_size)
        losses.append(loss.detach())  # read once after the loop: a float() here would be a host sync
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                unread.append((k, v))
            else:
                sums[k] = sums.get(k, 0.0) + v
    grad_norm: torch.Tensor | None = None
    if micro_batches:
        with record_function("asyncrl.clip"):
            grad_norm = clip_gradients(list(model.parameters()), max_grad_norm)
        with record_function("asyncrl.optimizer"):
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    # One host sync for the losses, the unread metrics and the gradient norm (fp32 and fp64 values are exact
    # in fp64), after the clip and the optimizer step are queued, so that nothing waits on the host in
    # between (`python benchmarks/trainer_mfu.py --help` shows how to time the step against other sync
    # placements).
    norm = [] if grad_norm is None else [grad_norm]
    values = [*losses, *(v for _, v in unread), *norm]
    read = torch.stack([v.double() for v in values]).tolist() if values else []
    sums["grad_norm"] = read.pop() if norm else 0.0
    for value in read[: len(losses)]:
        sums["loss"] += value
    for (k, _), value in zip(unread, read[len(losses) :], strict=True):
        sums[k] = sums.get(k, 0.0) + value
    return sums
