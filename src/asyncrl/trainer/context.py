"""``trainer.fabric.context_parallel``: a group of trainer ranks splits each packed row's sequence, so that
one sample too long for one GPU's activations trains across several.

torch's context parallelism does the work (``torch.distributed.tensor.experimental.context_parallel``):
entering its context shards the given buffers along the sequence (two chunks a rank, head and tail, which
balances a causal mask's work), and inside it SDPA's CUDA kernels run as ring attention over the group,
forward and backward. So the model attends through SDPA (``model.attn_implementation=sdpa``) with a plain
causal mask, and each row holds one sample (``pack_samples(one_per_row=True)``): packed samples would see
each other.

Around torch, this module keeps the trainer's contract: the model sees this rank's chunks (their token ids
and positions), each position is scored against the token after it in the *whole* row (shifted before
sharding), and the logprobs go back to the row's layout ``[B, T-1]`` with the loss mask cut to this rank's
tokens, so the loss and its metrics are this rank's share and their sum over the group is the row's (as over
data-parallel ranks). The ranks of a group are consecutive global ranks; FSDP2 still shards the weights over
every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from asyncrl.models import truncation
from asyncrl.models.logprobs import chunked_token_logprobs
from asyncrl.trainer.forward import OUTSIDE


class ContextParallel:
    """The trainer's context-parallel group (``size`` 1: none, every method a pass-through)."""

    def __init__(self, size: int, fabric: Any):
        self.size, self.mesh = size, None
        if size > 1:
            groups = fabric.world_size // size
            self.mesh = init_device_mesh(fabric.device.type, (groups, size), mesh_dim_names=("dp", "cp"))[
                "cp"
            ]

    @contextmanager
    def shard(self, mb: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """This rank's view of a micro-batch (on the device) for the forward *and* backward run inside:
        ``mb`` itself without a group; with one, the local chunks under torch's context (see the module's
        docstring)."""
        if self.mesh is None:
            yield mb
            return
        ids = mb["input_ids"]
        b, t = ids.shape
        local = {
            "input_ids": ids.clone(),
            "position_ids": mb["position_ids"].clone(),
            "target_ids": torch.roll(ids, -1, dims=1),  # entry i: token i + 1 (the last one has none)
            "target_temperatures": torch.roll(mb["temperatures"], -1, dims=1),
            # where each local entry sits
            "index": torch.arange(t, device=ids.device).expand(b, t).contiguous(),
            # the truncation each target was sampled under, when the micro-batch records one
            **{f"target_{k}": torch.roll(mb[k], -1, dims=1) for k in truncation.KEYS if k in mb},
        }
        buffers = list(local.values())
        with context_parallel(
            self.mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
        ):
            # the context shards the buffers in place; the dict still names them
            yield {**mb, **local, "loss_mask": local_loss_mask(mb["loss_mask"], local["index"])}


def local_loss_mask(loss_mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``loss_mask`` (entry ``i`` about token ``i``) kept only for the tokens this rank scores: those after
    one of its positions ``index``."""
    scored = torch.zeros_like(loss_mask, dtype=torch.bool).scatter_(1, index, True)
    out = torch.zeros_like(loss_mask)
    out[:, 1:] = loss_mask[:, 1:] * scored[:, :-1]
    return out


def scatter_to_row(local: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
    """Values of this rank's positions ``index`` (``[B, L]``) at their places in a row's ``[B, length - 1]``
    layout (entry ``j``: about token ``j + 1``), zero elsewhere; differentiable in ``local``. The row's last
    position predicts nothing and is dropped."""
    row = torch.zeros(local.shape[0], length, dtype=local.dtype, device=local.device)
    return row.scatter(1, index, local)[:, :-1]


def sharded_logprobs(
    model: torch.nn.Module, local: dict[str, Any], entropy_out: list | None = None
) -> torch.Tensor:
    """:func:`asyncrl.trainer.forward.packed_logprobs` for a micro-batch under :meth:`ContextParallel.shard`:
    the model on this rank's chunks, each position scored against its target, back in the row's layout."""
    ids, index = local["input_ids"], local["index"]
    # an all-ones mask: transformers then takes the causal path (no mask, is_causal) instead of reading the
    # jump in a load-balanced shard's positions as the start of a packed sample
    logits = model(
        input_ids=ids,
        position_ids=local["position_ids"],
        attention_mask=torch.ones_like(ids),
        use_cache=False,
    ).logits
    entropies: list | None = [] if entropy_out is not None else None
    cut = truncation.Truncation.of(
        {k: local[f"target_{k}"] for k in truncation.KEYS if f"target_{k}" in local}
    )
    lp = chunked_token_logprobs(logits, local["target_ids"], local["target_temperatures"], entropies, cut)
    length = local["loss_mask"].shape[1]
    if cut is not None and cut.outside is not None:
        local[OUTSIDE] = scatter_to_row(cut.outside.float(), index, length) > 0
    if entropy_out is not None and entropies:
        found = scatter_to_row(entropies[0], index, length)
        entropy_out.append(found[local["loss_mask"][:, 1:].bool()].float().cpu())
    return scatter_to_row(lp, index, length)
