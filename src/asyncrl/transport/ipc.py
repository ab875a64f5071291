"""``weights.transport=ipc``: on one GPU shared by the trainer and the vLLM sidecar, each new policy reaches
vLLM through a CUDA IPC handle instead of files.

The step contract is every streamed transport's (:mod:`asyncrl.transport.streamed`), with the handle in the
manifest:

1. After step ``n`` the trainer (one process, on the sidecar's GPU) copies the weights, cast to the serving
   dtype, into one GPU buffer it keeps, and publishes ``weights/step_{n+1}/`` holding only :data:`MANIFEST`:
   names, dtypes, shapes, byte sizes, the GPU's UUID and the buffer's CUDA IPC handle (JSON, no pickle: a
   sidecar never unpickles what a file says).
2. The orchestrator relays that version as any other (``POST /update_weights {path, version}``). The
   sidecar's worker opens the handle, copies each tensor into vLLM's parameters and lets go of it
   (:mod:`asyncrl.inference.vllm.worker`); the sidecar then writes :data:`LOADED` beside the manifest.
3. The trainer waits for :data:`LOADED` before the buffer may change again, so a version is never overwritten
   while it is read. Like a broadcast, every such version must be loaded, in order: ``strict_async=true``,
   and versions that checkpoints need on disk or that the orchestrator may never load go as files
   (:func:`asyncrl.transport.streamed.sent_directly`).

Torch-free at import (the config checks read :class:`IPC`); the trainer's and the worker's functions import
torch.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config.layout import inference_workers
from asyncrl.config.variants import TRANSPORTS
from asyncrl.transport.base import RELOADS, Transport
from asyncrl.transport.files import Files
from asyncrl.transport.streamed import StreamedOrFiles, export_entries, manifest_columns
from asyncrl.transport.weights import export_items
from asyncrl.utils.atomic import atomic_dir, write_text_atomic

if TYPE_CHECKING:
    import torch

    from asyncrl.config import Config

MANIFEST = "ipc.json"
LOADED = "ipc.loaded"


class IPC(Transport):
    """Trainer and vLLM on one GPU: the sidecar copies each policy from the trainer's buffer (see the
    module's docstring)."""

    name = "ipc"
    streamed = True
    manifest = MANIFEST

    @classmethod
    def config_errors(cls, cfg: Config) -> list[str]:
        errors = super().config_errors(cfg)
        fab, inf = cfg.trainer.fabric, cfg.inference
        if fab.devices != 1 or fab.num_nodes != 1:
            # the transports whose sidecars join the trainer's group: those that link GPUs
            linking = " or ".join(n for n in TRANSPORTS.names() if TRANSPORTS.get(n).rendezvous)
            errors.append(
                "weights.transport=ipc needs a one-process trainer "
                f"(trainer.fabric.devices={fab.devices}, num_nodes={fab.num_nodes}): it shares one buffer "
                f"on the sidecar's GPU; use weights.transport={linking} for a trainer on other GPUs"
            )
        # one url is fine: `asyncrl rl` writes its sidecar's into the config every process loads; a server
        # elsewhere is refused by its worker, which checks that the trainer's buffer is on its own GPU
        if len(inf.urls) > 1 or len(inf.gpus) > 1 or inference_workers(cfg) != 1:
            errors.append(
                "weights.transport=ipc needs one sidecar on one GPU (at most one inference.urls or "
                "inference.gpus entry, no tensor parallelism)"
            )
        sidecar_gpu = inf.gpus[0] if inf.gpus else ""
        if sidecar_gpu != fab.gpus:
            errors.append(
                "weights.transport=ipc needs the trainer on the sidecar's GPU: "
                f"trainer.fabric.gpus={fab.gpus!r}, inference.gpus={list(inf.gpus)!r} (set both to the same "
                "GPU with inference.share_gpus=true, or leave both empty)"
            )
        return errors

    @classmethod
    def publisher(cls, cfg: Config, fabric: Any, model: Any, tokenizer: Any) -> StreamedOrFiles:
        return StreamedOrFiles(cfg, IPCPublisher(cfg, model), Files.publisher(cfg, fabric, model, tokenizer))

    @classmethod
    def manifest_problem(cls, manifest: dict[str, Any], version: int) -> str | None:
        return manifest_problem(manifest, version)

    @classmethod
    def refusal(cls, path: Path, joined: bool) -> tuple[int, str] | None:
        if (path / LOADED).is_file():
            return 409, (
                f"{path} was loaded before and the trainer's buffer may hold a newer policy by now; a "
                "sidecar that restarted cannot load a version sent by weights.transport=ipc (resume from a "
                "checkpoint)"
            )
        return None

    @classmethod
    async def vllm_load(cls, engine: Any, path: Path, manifest: dict[str, Any], timeout_s: float) -> Any:
        """Copy from the trainer's buffer (:meth:`worker_load`), then free it for the next version."""
        start = time.perf_counter()
        workers = await super().vllm_load(engine, path, manifest, timeout_s)
        mark_loaded(path, time.perf_counter() - start)
        return workers

    @classmethod
    def worker_load(cls, worker: Any, model: Any, manifest: dict[str, Any], reload: str) -> set[str] | None:
        """Copy each tensor from the trainer's buffer into the serving model and let go of the buffer before
        returning (every copy done: the trainer may refill it once the sidecar marks the version loaded)."""
        import torch  # lazy: runs in vLLM's workers (the config checks import this module)

        buffer = open_shared(manifest, torch.cuda.current_device())
        try:
            views = shared_views(buffer, manifest)
            loaded = None
            if reload == "layerwise":  # vLLM's lifecycle, fed from the views
                worker.model_runner.reload_weights(weights_iterator=iter(views))
            else:
                loaded = set(model.load_weights(views) or ())
            torch.accelerator.synchronize()
        finally:
            del buffer
        return loaded


class IPCPublisher:
    """One process on the sidecar's GPU (:meth:`IPC.config_errors` checks), whose buffer the sidecar copies
    each policy from."""

    def __init__(self, cfg: Config, model: torch.nn.Module):
        from asyncrl.models.hf import TORCH_DTYPES  # lazy: torch

        self.model, self.timeout_s = model, cfg.trainer.wait_timeout_s
        self.sender = IPCSender(model, TORCH_DTYPES[cfg.model.dtype], cfg.weights.reload)

    def publish(self, version: int, path: Path) -> None:
        self.sender.send(self.model, path, version, self.timeout_s)  # returns once the sidecar copied it


# the fields of torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments, in order
_FIELDS = (
    "tensor_cls",
    "size",
    "stride",
    "offset",
    "storage_cls",
    "dtype",
    "device",
    "handle",
    "storage_size",
    "storage_offset",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
_BYTES = ("handle", "ref_counter_handle", "event_handle")


def _classes() -> dict[str, Any]:
    import torch  # lazy: the config checks import this module torch-free

    return {
        "Tensor": torch.Tensor,
        "TypedStorage": torch.storage.TypedStorage,
        "UntypedStorage": torch.UntypedStorage,
    }


def encode_handle(args: tuple) -> dict[str, Any]:
    """``reduce_tensor(t)[1]`` of a CUDA tensor as JSON-able fields (classes by name, bytes in base64)."""
    d = dict(zip(_FIELDS, args, strict=True))
    for key in ("tensor_cls", "storage_cls"):
        name = d[key].__name__
        if name not in _classes():
            raise ValueError(f"{key}={name}: only a plain tensor's handle can be shared")
        d[key] = name
    d["dtype"] = str(d["dtype"]).removeprefix("torch.")
    d["size"], d["stride"] = list(d["size"]), list(d["stride"])
    for key in _BYTES:
        d[key] = None if d[key] is None else base64.b64encode(d[key]).decode()
    return d


def decode_handle(d: dict[str, Any]) -> tuple:
    """The arguments of ``rebuild_cuda_tensor`` from :func:`encode_handle`'s fields (only known classes)."""
    classes = _classes()
    if set(d) != set(_FIELDS):
        raise ValueError(f"an IPC handle has the fields {sorted(_FIELDS)}, got {sorted(d)}")
    out = dict(d)
    for key in ("tensor_cls", "storage_cls"):
        if d[key] not in classes:
            raise ValueError(f"{key}={d[key]!r}: expected one of {sorted(classes)}")
        out[key] = classes[d[key]]
    import torch  # lazy: the config checks import this module torch-free

    out["dtype"] = getattr(torch, d["dtype"])
    out["size"], out["stride"] = torch.Size(d["size"]), tuple(d["stride"])
    for key in _BYTES:
        out[key] = None if d[key] is None else base64.b64decode(d[key])
    return tuple(out[k] for k in _FIELDS)


def write_manifest(
    path: Path,
    entries: list[tuple[str, str, list[int]]],
    sizes: list[int],
    version: int,
    gpu_uuid: str,
    handle: dict[str, Any],
    reload: str = "direct",
) -> None:
    """Publish ``path`` (a ``weights/step_N`` directory) holding only the manifest, atomically."""
    manifest = {
        "version": version,
        **manifest_columns(entries),
        "tensor_sizes": sizes,
        "gpu_uuid": gpu_uuid,
        "handle": handle,
        "reload": reload,
    }
    with atomic_dir(path) as tmp:
        (tmp / MANIFEST).write_text(json.dumps(manifest))


def manifest_problem(manifest: dict[str, Any], version: int) -> str | None:
    """Why a sidecar must not load ``manifest`` as policy ``version`` (``None`` when it may): fields missing
    or inconsistent, a handle that does not decode, or another version than the one asked for."""
    need = ("version", "names", "dtype_names", "shapes", "tensor_sizes", "gpu_uuid", "handle")
    if missing := [k for k in need if k not in manifest]:
        return f"the IPC manifest lacks {missing}"
    if manifest["version"] != version:
        return f"the IPC manifest holds version {manifest['version']}, not {version}"
    lengths = {len(manifest[k]) for k in ("names", "dtype_names", "shapes", "tensor_sizes")}
    if len(lengths) != 1:
        return "the IPC manifest's names, dtype_names, shapes and tensor_sizes differ in length"
    if manifest.get("reload", "direct") not in RELOADS:
        return f"reload={manifest['reload']!r}: expected one of {RELOADS}"
    try:
        decode_handle(manifest["handle"])
    except (ValueError, TypeError, AttributeError) as e:
        return f"the IPC manifest's handle: {e}"
    return None


def mark_loaded(path: Path, seconds: float) -> None:
    """The sidecar's side of step 3: the version in ``path`` is in vLLM's parameters; the buffer is free."""
    write_text_atomic(path / LOADED, json.dumps({"seconds": seconds}))


def wait_loaded(path: Path, timeout_s: float, poll_s: float = 0.002) -> float:
    """Block until the sidecar loaded the version in ``path``; the seconds waited. Raises after
    ``timeout_s``."""
    start = time.monotonic()
    while not (path / LOADED).is_file():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(
                f"{path}: no sidecar loaded this version within {timeout_s:.0f}s (weights.transport=ipc "
                "needs the orchestrator to relay every version in order; is it running?)"
            )
        time.sleep(poll_s)
    return time.monotonic() - start


class IPCSender:
    """The trainer's end: one GPU buffer holding the policy in the serving dtype, shared by handle."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, reload: str = "direct"):
        import torch  # lazy: the config checks import this module torch-free
        from torch.multiprocessing.reductions import reduce_tensor  # lazy: torch

        self.dtype, self.reload = dtype, reload
        self.entries = export_entries(model, dtype)
        self.sizes = [
            int(torch.Size(shape).numel()) * dtype.itemsize for _, _, shape in self.entries
        ]  # bytes of each tensor, in send order
        self.buffer = torch.empty(sum(self.sizes), dtype=torch.uint8, device=torch.cuda.current_device())
        self.gpu_uuid = str(torch.cuda.get_device_properties(self.buffer.device).uuid)
        # shared once, as vLLM's packed IPC producer does: each reduce_tensor of the same storage would chain
        # a new ref-counter slot and interprocess event onto it, none freed while the buffer lives
        self.handle = encode_handle(reduce_tensor(self.buffer)[1])

    def fill(self, model: torch.nn.Module) -> None:
        """Copy the model's current weights into the buffer (a cast where the dtypes differ); waits for the
        GPU."""
        import torch  # lazy: the config checks import this module torch-free
        from torch.distributed.tensor import DTensor  # lazy: torch

        offset = 0
        with torch.no_grad():
            for (name, tensor), (want, _, shape), size in zip(
                export_items(model), self.entries, self.sizes, strict=True
            ):
                if name != want:
                    raise RuntimeError(
                        f"the model's tensors changed since the manifest was made ({name} != {want})"
                    )
                # one process: the whole tensor
                src = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                self.buffer[offset : offset + size].view(self.dtype).view(shape).copy_(src)
                offset += size
        torch.cuda.synchronize()  # the sidecar reads the buffer from another process

    def publish(self, model: torch.nn.Module, path: Path, version: int) -> None:
        """Fill the buffer with ``model``'s weights and publish them as version ``version`` in ``path``."""
        self.fill(model)  # synchronized: the handle's event is from when it was shared, the copies are later
        write_manifest(path, self.entries, self.sizes, version, self.gpu_uuid, self.handle, self.reload)

    def send(self, model: torch.nn.Module, path: Path, version: int, timeout_s: float) -> float:
        """:meth:`publish`, then wait until the sidecar loaded the version (the buffer may change after
        that); the seconds spent waiting."""
        self.publish(model, path, version)
        return wait_loaded(path, timeout_s)


# -- sidecar side: in each vLLM worker ------------------------------------------------------------------


def open_shared(manifest: dict[str, Any], device_index: int) -> Any:
    """The trainer's buffer (a uint8 CUDA tensor) from a manifest, on this process's GPU; raises when the
    trainer's buffer lives on another GPU."""
    import torch  # lazy: runs in vLLM's workers (the config checks import this module)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor  # lazy: as torch

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
    import torch  # lazy: runs in vLLM's workers (the config checks import this module)

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
