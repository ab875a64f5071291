"""The sampled token's logprob and rank by one kernel, copied to the host once a step
(``inference.vllm.logprobs_kernel``).

vLLM 0.26's model runner for dense models (V2) computes a step's sample logprobs with two Triton kernels
(``_topk_log_softmax_kernel``: each row's max and log-sum-exp, then the chosen ids' logit minus both;
``_ranks_kernel``: how many ids score at least the sampled one) and a handful of tensor ops, and its output
copier then copies ids, logprobs and ranks to the host one by one, each into newly allocated pinned memory.
The engine core's loop pays for every launch and copy on the host while the GPU waits on it (a 0.6B model's
decode step is host-bound on an H200). When no request of the step asks for more than the sampled token's
logprob (``logprobs=0``, what RL samples with), :func:`sampled_logprobs` does the same arithmetic in one
launch that writes one int32 array ``[3, batch]`` (token ids, the logprobs' float32 bits, ranks): one copy to
the host, three numpy views of it.

The kernel's max and sum-of-exponentials loops are vLLM's, op for op, block size included, and the logprob is
``logit - max - log(sum)`` in the same order, so the numbers are vLLM's to the bit (the GPU test
``test_logprobs_kernel_equals_vllms`` compares them over random and masked rows); ranks are counts, exact
either way. Steps with top-k logprobs, chosen token ids' logprobs, logits modes or several tokens a request
(speculative decoding) go to vLLM's function unchanged; MoE models, which vLLM 0.26 runs on its first model
runner, are left as they are. Installed by asyncrl's vLLM plugin (:mod:`asyncrl.inference.vllm.plugin`) in
the engine-core process when ``ASYNCRL_LOGPROBS_KERNEL=1``, for the vLLM it was written against only
(:func:`problem`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
from typing import Any

ENV = "ASYNCRL_LOGPROBS_KERNEL"
LOG_LINE = "the sampled token's logprob and rank by one kernel, one copy a step"
# the vLLM release whose V2 sampler, compute_topk_scores and LogprobsTensors this is written for
VERSION = "0.26."
SAMPLER = "vllm.v1.worker.gpu.sample.sampler"
SIGNATURE = (  # compute_topk_scores' parameters in that release
    "logits",
    "num_logprobs",
    "sampled_token_ids",
    "cu_num_logits",
    "logprob_token_ids_state",
    "expanded_idx_mapping",
    "max_per_req_token_ids",
    "logits_mode",
)
BLOCK, RANK_BLOCK = 1024, 8192  # vLLM's block sizes for the two loops (the sum's order depends on the first)


def wanted() -> bool:
    """Whether this process computes logprobs by :func:`sampled_logprobs` (the sidecar exports
    :data:`ENV`)."""
    return os.environ.get(ENV) == "1"


def problem(version: str, signature: tuple[str, ...] | None) -> str | None:
    """Why the kernel would not be vLLM's arithmetic in this vLLM (``None``: it is): another release, or a
    ``compute_topk_scores`` of other parameters (``signature``; ``None``: the V2 sampler does not import
    it)."""
    if not version.startswith(VERSION):
        return f"written for vLLM {VERSION}x, this is vLLM {version}"
    if signature is None:
        return f"vLLM's {SAMPLER} does not import compute_topk_scores"
    if signature != SIGNATURE:
        return f"vLLM's {SAMPLER}.compute_topk_scores takes {signature}, not {SIGNATURE}"
    return None


def covers(
    num_logprobs: int, cu_num_logits: Any, max_per_req_token_ids: int, logits_mode: bool, rows: int
) -> bool:
    """Whether a step's logprobs are the kernel's to compute: the sampled token's only, one a request,
    logprobs (not logits), at least one row."""
    return (
        num_logprobs == 0
        and cu_num_logits is None
        and not max_per_req_token_ids
        and not logits_mode
        and rows > 0
    )


@functools.cache
def _kernel() -> Any:
    from asyncrl.inference.vllm import sampled_kernel  # lazy: Triton is GPU-only

    return sampled_kernel.sampled_logprob_kernel


def unpack(packed: Any, tensors: type) -> Any:
    """``tensors`` (vLLM's ``LogprobsTensors``) of views into ``packed`` (int32 ``[3, rows]``: ids, logprob
    bits, ranks): ids and logprobs ``[rows, 1]`` (the sampled token's column), ranks ``[rows]``."""
    import torch  # lazy: vLLM's processes have it; this module imports on a CPU machine without it mattering

    rows = packed.shape[1]
    return tensors(packed[0].view(rows, 1), packed[1].view(torch.float32).view(rows, 1), packed[2], None)


def sampled_logprobs(logits: Any, sampled_token_ids: Any, tensors: type) -> Any:
    """The step's ``LogprobsTensors`` for the sampled tokens (``logits``: ``[rows, vocab]``, as vLLM passes
    them to ``compute_topk_scores``; ``sampled_token_ids``: ``[rows]``), by one launch into one packed array;
    copying the result to the host (``to_cpu_nonblocking``) copies that array once."""
    import torch  # lazy: as in unpack

    rows, vocab = logits.shape
    packed = torch.empty((3, rows), dtype=torch.int32, device=logits.device)
    ids = sampled_token_ids.reshape(rows)
    _kernel()[(rows,)](packed, rows, logits, logits.stride(0), ids, vocab, BLOCK=BLOCK, RANKS=RANK_BLOCK)
    return _packed_class(tensors)(*unpack(packed, tensors), packed=packed)


@functools.cache
def _packed_class(tensors: type) -> type:
    """A ``tensors`` (vLLM's ``LogprobsTensors``) whose fields are views of one packed array, copied as
    one."""

    class PackedLogprobs(tensors):
        def __new__(cls, *fields: Any, packed: Any) -> Any:
            self = super().__new__(cls, *fields)
            self.packed = packed
            return self

        def to_cpu_nonblocking(self) -> Any:
            return unpack(self.packed.to("cpu", non_blocking=True), tensors)

    return PackedLogprobs


def install(module: Any = None, version: str | None = None) -> None:
    """Route the V2 sampler's ``compute_topk_scores`` (in ``module``, default vLLM's sampler module) through
    :func:`sampled_logprobs` for the steps it :func:`covers`; refuses (``RuntimeError``) a vLLM it was not
    written for (``version``: default vLLM's own)."""
    if module is None:
        import vllm  # lazy: vLLM is GPU-only

        module, version = importlib.import_module(SAMPLER), vllm.__version__
    if getattr(module, "_asyncrl_logprobs_kernel", False):
        return
    original = getattr(module, "compute_topk_scores", None)
    signature = None if original is None else tuple(inspect.signature(original).parameters)
    if (why := problem(str(version), signature)) or original is None:
        raise RuntimeError(
            f"inference.vllm.logprobs_kernel=true: {why}; set inference.vllm.logprobs_kernel=false"
        )
    tensors = module.LogprobsTensors if hasattr(module, "LogprobsTensors") else _logprobs_tensors()

    @functools.wraps(original)
    def compute_topk_scores(logits, num_logprobs, sampled_token_ids, cu_num_logits=None, *args, **kwargs):
        per_req = kwargs.get("max_per_req_token_ids", args[2] if len(args) > 2 else 0)
        mode = kwargs.get("logits_mode", args[3] if len(args) > 3 else False)
        if covers(num_logprobs, cu_num_logits, per_req, mode, logits.shape[0]):
            return sampled_logprobs(logits, sampled_token_ids, tensors)
        return original(logits, num_logprobs, sampled_token_ids, cu_num_logits, *args, **kwargs)

    module.compute_topk_scores = compute_topk_scores
    module._asyncrl_logprobs_kernel = True
    # under vLLM's logger, so it lands in the sidecar's log with vLLM's own lines (the GPU test looks for it)
    logging.getLogger("vllm.asyncrl").info(f"asyncrl: {LOG_LINE} ({module.__name__})")


def _logprobs_tensors() -> type:
    from vllm.v1.outputs import LogprobsTensors  # lazy: vLLM is GPU-only

    return LogprobsTensors
