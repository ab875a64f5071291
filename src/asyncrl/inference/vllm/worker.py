"""asyncrl's vLLM worker extension (``--worker-extension-cls``, on every transport): one RPC checks an update
on the meta device before anything loads (:func:`dry_run_problems`), one loads a policy that a transport
with a manifest sent (a broadcast, a buffer on the same GPU) by calling that transport's own
:meth:`asyncrl.transport.base.Transport.worker_load` in mode :func:`reload_mode`, then checks that every
parameter was loaded.

vLLM 0.26's own path (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) runs its
layerwise reload lifecycle for every update: each layer is put back on the meta device, re-materialised,
loaded, processed and copied into the old storage (so CUDA graphs keep their pointers). That lifecycle exists
for quantized layers, whose ``process_weights_after_loading`` rewrites what was loaded. An unquantized model
on CUDA has nothing to process (``UnquantizedLinearMethod.process_weights_after_loading`` is a no-op there),
so ``reload="direct"`` hands each received tensor to the model's own ``load_weights``, whose weight loaders
copy into the existing parameters in place. Quantized models, and ``reload="layerwise"``, take vLLM's path;
so do mixtures of experts whose MoE kernel keeps its weights in a layout of its own
(:data:`DIRECT_MOE_BACKENDS`).

vLLM is imported inside the functions that run in its workers: the CPU install has no vLLM, and the sidecar's
HTTP side and the CPU tests import this module for :data:`EXTENSION` and the pure helpers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from asyncrl.config.variants import TRANSPORTS
from asyncrl.inference.vllm.weights_check import FLOATING
from asyncrl.transport.base import RELOADS

log = logging.getLogger("asyncrl.inference")

EXTENSION = "asyncrl.inference.vllm.worker.WeightReceiver"

# vLLM 0.26's unquantized MoE kernels that serve the experts in the layout their weight loader writes: on
# CUDA, convert_to_unquantized_kernel_format (vllm/model_executor/layers/fused_moe/oracle/unquantized.py)
# only makes Triton's weights contiguous, while FlashInfer's swap the gate and up halves or re-block them
# after loading, which a direct load would skip (on Hopper vLLM prefers Triton)
DIRECT_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")

# vLLM 0.26's MoERunner.load_weights (vllm/model_executor/layers/fused_moe/runner/moe_runner.py, line 295)
# answers its RoutedExperts' parameter names (``w13_weight``) relative to the runner, while
# named_parameters() finds them under the runner's ``routed_experts`` child
_ROUTED = ".routed_experts."


def reload_mode(
    requested: str, quantized: bool, cuda: bool, moe_backends: frozenset[str] = frozenset()
) -> str:
    """How a worker loads a broadcast policy: ``direct`` only where vLLM would have nothing to process after
    loading (an unquantized model on CUDA whose MoE kernels, ``moe_backends``, if any, are in
    :data:`DIRECT_MOE_BACKENDS`), else vLLM's ``layerwise`` lifecycle."""
    if requested not in RELOADS:
        raise ValueError(f"reload={requested!r}: expected one of {RELOADS}")
    plain_moe = moe_backends <= set(DIRECT_MOE_BACKENDS)
    return "direct" if requested == "direct" and not quantized and cuda and plain_moe else "layerwise"


def moe_backends(model: Any) -> frozenset[str]:
    """The names of the unquantized MoE kernels ``model``'s expert layers run on (vLLM's
    ``UnquantizedMoeBackend``; ``"?"`` for a layer whose method names none, a quantized one); empty for a
    dense model."""
    names = set()
    for module in model.modules():
        if hasattr(module, "w13_weight"):  # vLLM's RoutedExperts: a layer's experts
            method = getattr(module, "quant_method", None)
            # FusedMoEModularMethod wraps the one selected
            method = getattr(method, "old_quant_method", method)
            backend = getattr(method, "unquantized_backend", None)
            names.add(getattr(backend, "name", "?"))
    return frozenset(names)


def missing_parameters(expected: set[str], loaded: set[str]) -> list[str]:
    """Parameters of the serving model that a full update left unloaded (the check vLLM's own loader makes),
    the experts' under the names their loader answers."""
    return sorted({n.replace(_ROUTED, ".") for n in expected} - {n.replace(_ROUTED, ".") for n in loaded})


def check_all_loaded(model: Any, loaded: set[str], what: str) -> None:
    """Raise, naming them, when ``what`` (a broadcast, a shared policy) left parameters of ``model``
    unloaded."""
    if missing := missing_parameters({n for n, _ in model.named_parameters()}, loaded):
        raise RuntimeError(
            f"the {what} left {len(missing)} parameters of the serving model unloaded (first: "
            f"{missing[:5]}): trainer and sidecar models differ"
        )


def meta_twin(param: Any) -> Any:
    """A parameter of ``param``'s class and shape on the meta device, carrying its attributes (vLLM keeps a
    parameter's ``weight_loader``, sharding dims and the like on the parameter object)."""
    twin = torch.nn.Parameter._make_subclass(type(param), torch.empty_like(param.data, device="meta"), False)
    twin.__dict__.update(param.__dict__)
    return twin


@contextmanager
def on_meta(model: Any) -> Iterator[None]:
    """Every parameter and buffer of ``model`` replaced by a meta-device twin while the block runs, then the
    originals put back (the same objects: nothing that holds them, CUDA graphs included, sees a change).
    Nothing may run the model meanwhile (the sidecar pauses generation around it)."""
    twins: dict[int, Any] = {}  # a tied parameter gets one twin
    saved = []
    for module in model.modules():
        for kind, slots in (("param", module._parameters), ("buffer", module._buffers)):
            for name, t in slots.items():
                if t is None:
                    continue
                if id(t) not in twins:
                    twins[id(t)] = meta_twin(t) if kind == "param" else torch.empty_like(t, device="meta")
                saved.append((slots, name, t))
    try:
        for slots, name, t in saved:
            slots[name] = twins[id(t)]
        yield
    finally:
        for slots, name, t in saved:
            slots[name] = t


def dry_run_problems(model: Any, entries: list[tuple[str, str, list[int]]], quantized: bool) -> list[str]:
    """Why ``entries`` (name, dtype, shape) cannot be loaded into ``model``, found by loading meta tensors of
    those shapes through the model's own ``load_weights`` with every parameter on the meta device: its weight
    loaders refuse names the model lacks and shapes that do not fit (this worker's tensor-parallel shard),
    and what is left unloaded is named. An unquantized model takes floating-point tensors only. Empty: the
    real load can start."""
    if not quantized and (ints := [n for n, d, _ in entries if d not in FLOATING]):
        return [
            f"{len(ints)} tensors are not floating point (first: {ints[:3]}); the served model's weights are"
        ]
    tensors = (
        (name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
        for name, dtype, shape in entries
    )
    with on_meta(model):
        try:
            loaded = set(model.load_weights(tensors) or ())
        except (NotImplementedError, RuntimeError) as e:
            if "meta" not in str(e):  # a shape that does not narrow or copy
                return [f"the served model does not take these weights: {type(e).__name__}: {e}"[:2000]]
            # a loader that reads values (a quantized scale's .item()) cannot run on the meta device: this
            # model is checked by the headers against its starting model only, and a failed load is recovered
            # from
            log.warning(f"the meta-device check of weight updates cannot run on this model ({e}); skipped")
            return []
        # vLLM's loaders raise ValueError, KeyError, AssertionError for what does not fit
        except Exception as e:
            return [f"the served model does not take these weights: {type(e).__name__}: {e}"[:2000]]
    if missing := missing_parameters({n for n, _ in model.named_parameters()}, loaded):
        return [
            f"{len(missing)} parameters of the served model are not in the update (first: {missing[:5]})"
        ]
    return []


class WeightReceiver:
    """Mixed into vLLM's GPU worker (``self`` is the worker: ``weight_transfer_engine``, ``model_runner``,
    ``vllm_config``, and vLLM's ``start/update/finish_weight_update``)."""

    def _quantized(self) -> bool:
        c = self.vllm_config  # type: ignore[attr-defined]
        return c.quant_config is not None or c.model_config.quantization is not None

    def asyncrl_check_weights(self, entries: list[tuple[str, str, list[int]]]) -> list[str]:
        """:func:`dry_run_problems` of ``entries`` on this worker's model (nothing is loaded)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return dry_run_problems(model, entries, self._quantized())

    def _reload_mode(self, requested: str) -> str:
        from vllm.platforms import current_platform  # in vLLM's worker; the CPU install has no vLLM

        w: Any = self
        backends = moe_backends(w.model_runner.get_model())
        return reload_mode(requested, self._quantized(), current_platform.is_cuda(), backends)

    def asyncrl_load(self, transport: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Load the policy ``manifest`` describes the way the transport that sent it does in a worker
        (``transport``: its ``package.module:Class`` path; its
        :meth:`~asyncrl.transport.base.Transport.worker_load`); returns the mode used and the seconds it
        took on this worker. Raises when a direct load left a parameter unloaded."""
        w: Any = self
        start = time.perf_counter()
        sender = TRANSPORTS.get(transport)
        mode = self._reload_mode(manifest.get("reload", "direct"))
        model = w.model_runner.get_model()
        loaded = sender.worker_load(w, model, manifest, mode)
        if loaded is not None:
            check_all_loaded(model, loaded, f"{sender.name} update")
        return {"reload": mode, "seconds": time.perf_counter() - start}
