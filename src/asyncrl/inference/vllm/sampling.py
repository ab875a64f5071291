"""vLLM's top-k / top-p by one rule in every batch: the sort-based one the trainer mirrors.

vLLM 0.26 masks top-k / top-p with a Triton pivot search (a bisection over probabilities, at most 18 rounds)
when a batch has 8 rows or more and by sorting (``apply_top_k_top_p_pytorch``) below that. The two can keep
different tokens at the nucleus' edge, and which one ran depends on how many requests shared the step, which
the trainer cannot know. The trainer scores each sampled token under the sort rule's kept set
(:mod:`asyncrl.models.truncation`), so the sidecar samples by that rule alone: :func:`install` points every
module that calls ``apply_top_k_top_p`` at the sort. It costs one sort of each truncated row's logits a
decode step; requests without top-k / top-p skip it as before.
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)

# the modules that call vLLM 0.26's apply_top_k_top_p through a module global (their own, or an imported
# name)
CALLERS = (
    "vllm.v1.sample.ops.topk_topp_sampler",
    "vllm.v1.sample.rejection_sampler",
    "vllm.v1.worker.gpu.sample.states",
    "vllm.v1.worker.gpu.sample.sampler",
)


def install() -> list[str]:
    """Every importable caller's ``apply_top_k_top_p`` becomes the sort; returns the modules patched (none,
    with a warning, where this vLLM has no sort-based top-k / top-p: truncated samples' ratios are then
    inexact)."""
    try:
        ops = importlib.import_module(CALLERS[0])
        sort = ops.apply_top_k_top_p_pytorch
    except (ImportError, AttributeError):
        log.warning(
            "vLLM has no %s.apply_top_k_top_p_pytorch: top-k / top-p keep vLLM's own rule", CALLERS[0]
        )
        return []

    patched = []
    for name in CALLERS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a runner this vLLM build does not ship
            continue
        if hasattr(module, "apply_top_k_top_p"):
            setattr(module, "apply_top_k_top_p", sort)  # noqa: B010 (a module global, by name)
            patched.append(name)
    return patched
