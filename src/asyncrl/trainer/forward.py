"""The trainer's packed forward pass: micro-batches moved to the device, and the next-token logprobs of their
packed rows (eager, compiled, or the ``numerics=bitwise`` kernel a model carries)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from asyncrl.models import attention
from asyncrl.models.logprobs import chunked_logprobs, compute_logprobs, sampled_logprobs
from asyncrl.models.truncation import Truncation
from asyncrl.trainer.parallel import inductor_for_varying_shapes

PACKED_KWARGS = "packed_attention_kwargs"  # the key micro_batch_to_device adds (not a tensor: never sent on)
# the key packed_logprobs adds to a truncated micro-batch: [B, T-1] bool, the tokens scored outside their
# kept set (asyncrl.models.truncation), for the loss to count
OUTSIDE = "truncation_outside"


def micro_batch_to_device(mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """A packed micro-batch's tensors on ``device``, plus its samples' boundaries for the attention kernels
    (:func:`asyncrl.models.attention.packed_kwargs`, under :data:`PACKED_KWARGS`) computed from the host copy
    of ``position_ids``: on a GPU that computation is two host syncs (``nonzero``, the longest sample).

    On CUDA the copies are non-blocking from pinned memory. A copy from pageable memory waits for all the
    work queued before it: moving micro-batch k+1 would wait for k's backward, then the GPU would idle while
    the host launched the next forward."""
    device = torch.device(device)
    cuda = device.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        return (t.pin_memory() if cuda and not t.is_cuda else t).to(device, non_blocking=cuda)

    out: dict[str, Any] = {k: move(v) for k, v in mb.items()}
    kwargs = attention.packed_kwargs(mb["position_ids"].cpu())
    kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = move(kwargs["cu_seq_lens_q"])
    out[PACKED_KWARGS] = kwargs
    return out


def micro_batches_to_device(
    micro_batches: list[dict[str, torch.Tensor]], device: torch.device
) -> list[dict]:
    """A step's micro-batches on ``device``, every copy queued up front (:func:`micro_batch_to_device`)."""
    return [micro_batch_to_device(mb, device) for mb in micro_batches]


def packed_logprobs(
    model: torch.nn.Module, mb: dict[str, Any], entropy_out: list | None = None
) -> torch.Tensor:
    """Next-token logprobs ``[B, T-1]`` of a packed micro-batch (samples separated by position resets); with
    ``entropy_out``, the entropies of its loss tokens are appended to it (a 1-D CPU tensor).

    ``use_cache=False`` matters: with a cache transformers skips packed-sequence detection and tokens
    would attend across samples.
    """
    extra: dict[str, Any] = {}
    if attention.takes_packed_kwargs(getattr(getattr(model, "config", None), "_attn_implementation", None)):
        # once a forward, not in every layer; from the host copy when micro_batch_to_device made one
        extra = mb[PACKED_KWARGS] if PACKED_KWARGS in mb else attention.packed_kwargs(mb["position_ids"])
    routing = getattr(model, "asyncrl_routing", None)  # a mixture of experts (asyncrl.models.moe.Routing)
    with routing.given(mb.get("routed_experts")) if routing is not None else nullcontext():
        logits = model(
            input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False, **extra
        ).logits
    # numerics=bitwise: the sampler's own logprob kernel (asyncrl.models.bitwise.install sets it);
    # trainer.fabric.compile: compute_logprobs compiled (compiled_logprobs); else chunked on GPUs (a long
    # row's [T, vocab] fp32 tensors are GBs), the exact eager formula on the CPU (reproducible runs record
    # its roundings)
    logprobs_of = getattr(model, "asyncrl_token_logprobs", None) or (
        chunked_logprobs if logits.is_cuda else compute_logprobs
    )
    # a micro-batch sampled under top-k / top-p / min-p records them; each token is then scored under its own
    # truncated distribution (without them the call is the plain one)
    truncation = Truncation.of(mb)
    kw: dict[str, Any] = {} if truncation is None else {"truncation": truncation}
    if entropy_out is None:
        logprobs = logprobs_of(logits, mb["input_ids"], mb["temperatures"], **kw)
    else:
        found: list[torch.Tensor] = []
        logprobs = logprobs_of(logits, mb["input_ids"], mb["temperatures"], found, **kw)
        entropy_out.append(found[0][mb["loss_mask"][:, 1:].bool()].float().cpu())
    if truncation is not None:
        mb[OUTSIDE] = truncation.outside
    return logprobs


def compiled_logprobs(dynamic: bool | None = None) -> Callable[..., torch.Tensor]:
    """:func:`compute_logprobs` under ``torch.compile`` (``trainer.fabric.compile``): the temperature,
    log-softmax and gather over the vocabulary fuse into one pass over the logits, forward and backward,
    instead of several fp32 tensors of ``[T, vocab]`` (10 GB each for a 16k row and a 152k vocabulary). With
    ``entropy_out`` or a truncation (the whole distribution is needed) it runs uncompiled, chunked
    (:func:`asyncrl.models.logprobs.chunked_logprobs`).

    ``dynamic=None`` (torch's automatic dynamic shapes): the token count turns symbolic when it first changes
    and the vocabulary, which never does, stays a constant in the kernels. With ``dynamic=True`` the
    vocabulary is symbolic too, and the pointwise backward over the flattened ``[T, vocab]`` logits splits
    each index by a runtime value (``python benchmarks/trainer_mfu.py --help`` shows how to compare the
    two)."""
    inductor_for_varying_shapes()
    fused = torch.compile(sampled_logprobs, dynamic=dynamic)

    def logprobs_of(
        logits,
        input_ids,
        temperatures,
        entropy_out: list | None = None,
        truncation: Truncation | None = None,
    ) -> torch.Tensor:
        # the whole distribution is needed: chunked, uncompiled
        if entropy_out is not None or truncation is not None:
            return chunked_logprobs(logits, input_ids, temperatures, entropy_out, truncation)
        return fused(logits, input_ids, temperatures)

    return logprobs_of


def batch_to_torch(micro_batches: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.as_tensor(v) for k, v in mb.items()} for mb in micro_batches]
