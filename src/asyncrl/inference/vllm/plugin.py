"""asyncrl's vLLM plugin (entry point ``vllm.general_plugins`` in pyproject.toml): it makes vLLM mask top-k /
top-p by sorting in every batch, the rule the trainer scores truncated samples with
(:mod:`asyncrl.inference.vllm.sampling`); under ``numerics=bitwise`` it makes vLLM's residual RMSNorm
batch-invariant, so the trainer can compute vLLM's rows bit for bit; with ``inference.vllm.defer_logprobs``
it sends each request's sample logprobs once, when it finishes (:mod:`asyncrl.inference.vllm.logprobs`); with
``inference.vllm.logprobs_kernel`` the sampled tokens' logprobs come from one kernel and one copy a step
(:mod:`asyncrl.inference.vllm.sampled`).

vLLM loads general plugins in every process it starts (engine core, workers) before the model is built, from
the entry points of installed packages: asyncrl must be installed (``pip install -e .``, as ``make install``
and the images do), not merely on ``PYTHONPATH``. The sidecar refuses to start under ``numerics=bitwise``
when vLLM would not load it (:func:`plugin_problem`).
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

from asyncrl.inference.vllm import frontend, logprobs, sampled, sampling
from asyncrl.models import bitwise
from asyncrl.numerics import MARKER

GROUP, NAME = "vllm.general_plugins", "asyncrl_bitwise"


def wanted() -> bool:
    """Whether this process runs under ``numerics=bitwise`` (set for every asyncrl process and its
    children)."""
    return os.environ.get(MARKER) == "bitwise" and os.environ.get("VLLM_BATCH_INVARIANT") == "1"


def register() -> None:
    """vLLM's plugin hook: top-k / top-p by sorting (:func:`asyncrl.inference.vllm.sampling.install`); under
    ``numerics=bitwise``, ``_custom_ops.fused_add_rms_norm`` becomes
    :func:`asyncrl.models.bitwise.fused_add_rms_norm` (vLLM's batch-invariant RMSNorm looks it up at each
    call); with ``ASYNCRL_DEFER_LOGPROBS=1``, the scheduler defers logprobs
    (:func:`asyncrl.inference.vllm.logprobs.install`); with ``ASYNCRL_LOGPROBS_KERNEL=1``, the sampled
    tokens' logprobs come from one kernel (:func:`asyncrl.inference.vllm.sampled.install`)."""
    sampling.install()
    if logprobs.wanted():  # the engine core keeps the arrays, the frontend reads a request's rows in bulk
        logprobs.install()
        frontend.install_frontend()
    if sampled.wanted():  # one kernel and one copy a step for the sampled tokens' logprobs
        sampled.install()
    if not wanted():
        return
    import vllm._custom_ops as ops  # GPU-only: the CPU install has no vLLM

    ops.fused_add_rms_norm = bitwise.fused_add_rms_norm


def plugin_problem() -> str | None:
    """Why vLLM, started from this environment, would not load the plugin (``None`` when it would): the entry
    point is not installed, or ``VLLM_PLUGINS`` (vLLM's allowlist) leaves it out."""
    if not any(ep.name == NAME for ep in entry_points(group=GROUP)):
        return (
            f"asyncrl's vLLM plugin (entry point {GROUP}: {NAME}) is not installed: vLLM finds plugins "
            "among installed packages, so install asyncrl in the sidecar's environment (pip install -e .)"
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and NAME not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} leaves out asyncrl's plugin {NAME!r}; add it to the list"
    return None


def in_force() -> bool:
    """Whether :func:`register` took effect in this process."""
    import vllm._custom_ops as ops  # GPU-only: the CPU install has no vLLM

    return ops.fused_add_rms_norm is bitwise.fused_add_rms_norm
