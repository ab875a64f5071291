"""asyncrl's vLLM worker extension (``--worker-extension-cls``, on every transport): one RPC checks an update
on the meta device before anything loads (:func:`dry_run_problems`), one receives a broadcast policy (or
copies one from the trainer's buffer on the same GPU) and loads it.

vLLM 0.26's own path (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) runs its
layerwise reload lifecycle for every update: each layer is put back on the meta device, re-materialised,
loaded, processed and copied into the old storage (so CUDA graphs keep their pointers). That lifecycle exists
for quantized layers, whose ``process_weights_after_loading`` rewrites what was loaded. An unquantized model
on CUDA has nothing to process (``UnquantizedLinearMethod.process_weights_after_loading`` is a no-op there),
so ``reload="direct"`` hands each received bucket to the model's own ``load_weights``, whose weight loaders
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
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from asyncrl.inference.weights_check import FLOATING
from asyncrl.transport.base import RELOADS
from asyncrl.transport.ipc import decode_handle

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


def receive_direct(engine: Any, model: Any, update_info: dict[str, Any]) -> set[str]:
    """Receive one packed broadcast through vLLM's consumer, each bucket straight into
    ``model.load_weights``; returns the names of the parameters it loaded."""
    # vLLM is GPU-only (the CPU install has none); this runs in its workers
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    info = engine.parse_update_info(update_info)  # vLLM's validation of names/dtypes/shapes
    if engine.model_update_group is None:
        raise RuntimeError("no NCCL group yet: POST /init_weight_transfer first")
    if not info.packed:
        raise ValueError("reload=direct receives packed broadcasts (the manifest sets packed=true)")
    loaded: set[str] = set()

    def load(weights: list) -> None:
        # the views alias the receive buffer, which the consumer frees after this call: load_weights copies
        # them into the parameters on the current stream before the next bucket is received into a new one
        loaded.update(model.load_weights(weights) or ())

    packed_nccl_broadcast_consumer(
        iterator=(
            (name, (shape, getattr(torch, dtype)))
            for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes, strict=True)
        ),
        group=engine.model_update_group,
        src=0,
        post_unpack_func=load,
        buffer_size_bytes=info.packed_buffer_size_bytes,
        num_buffers=info.packed_num_buffers,
        device=engine.device,
    )
    torch.accelerator.synchronize()  # the next forward must see every copy
    return loaded


def open_shared(manifest: dict[str, Any], device_index: int) -> Any:
    """The trainer's buffer (a uint8 CUDA tensor) from an IPC manifest (transport/ipc.py), on this process's
    GPU; raises when the trainer's buffer lives on another GPU."""

    here = str(torch.cuda.get_device_properties(device_index).uuid)
    if manifest["gpu_uuid"] != here:
        raise RuntimeError(
            "weights.transport=ipc: the trainer's buffer is on GPU "
            f"{manifest['gpu_uuid']}, this sidecar on {here}; "
            "put both on one GPU (trainer.fabric.gpus = inference.gpus[0])"
        )
    args = list(decode_handle(manifest["handle"]))
    args[6] = device_index  # the device as this process numbers it (vLLM does the same)
    return rebuild_cuda_tensor(*args)


def shared_views(buffer: Any, manifest: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(name, tensor)`` views of the shared buffer, as the manifest lays them out (no copy)."""
    sizes = manifest["tensor_sizes"]
    if sum(sizes) > buffer.numel():
        raise ValueError(
            f"the manifest describes {sum(sizes)} bytes, the shared buffer holds {buffer.numel()}"
        )
    parts = buffer[: sum(sizes)].split(sizes)
    return [
        (name, part.view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, part in zip(
            manifest["names"], manifest["dtype_names"], manifest["shapes"], parts, strict=True
        )
    ]


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

    def asyncrl_receive_weights(self, update_info: dict[str, Any], reload: str = "direct") -> dict[str, Any]:
        """Receive the broadcast described by ``update_info`` (vLLM's NCCL update-info fields); returns the
        mode used and the seconds it took on this worker. Raises when a direct load left a parameter
        unloaded."""
        w: Any = self
        start = time.perf_counter()
        if w.weight_transfer_engine is None:
            raise RuntimeError(
                "the server was not started with a weight-transfer config (weights.transport=nccl)"
            )
        mode = self._reload_mode(reload)
        if mode == "layerwise":
            w.start_weight_update()
            w.update_weights(update_info)
            w.finish_weight_update()
        else:
            model = w.model_runner.get_model()
            check_all_loaded(
                model, receive_direct(w.weight_transfer_engine, model, update_info), "broadcast"
            )
        return {"reload": mode, "seconds": time.perf_counter() - start}

    def asyncrl_load_ipc(self, manifest: dict[str, Any], reload: str = "direct") -> dict[str, Any]:
        """Copy the policy a ``weights.transport=ipc`` manifest describes from the trainer's GPU buffer into
        the serving model; returns the mode used and the seconds it took. The buffer is let go of before
        returning."""
        w: Any = self
        start = time.perf_counter()
        mode = self._reload_mode(reload)
        model = w.model_runner.get_model()
        buffer = open_shared(manifest, torch.cuda.current_device())
        try:
            views = shared_views(buffer, manifest)
            if mode == "layerwise":  # vLLM's lifecycle, fed from the views
                w.model_runner.reload_weights(weights_iterator=iter(views))
            else:
                check_all_loaded(model, set(model.load_weights(views) or ()), "shared policy")
            torch.accelerator.synchronize()  # every copy done before the trainer may overwrite the buffer
        finally:
            del buffer
        return {"reload": mode, "seconds": time.perf_counter() - start}
