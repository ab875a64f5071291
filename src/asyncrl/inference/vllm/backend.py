"""The vLLM backend's answers to the shared admin routes (:class:`asyncrl.inference.admin_routes.Backend`), and
``POST /init_weight_transfer`` (joining the trainer's NCCL group), which only this backend serves.

A policy arrives as a safetensors directory (``collective_rpc("reload_weights")``, in place, no restart), a LoRA
adapter directory (``model.lora``: loaded as vLLM's adapter under the served model's name, :func:`load_adapter`),
the manifest of an NCCL broadcast (``weights.transport=nccl``: one RPC to asyncrl's worker extension,
:mod:`asyncrl.inference.vllm.worker`) or of the trainer's shared GPU buffer (``weights.transport=ipc``, after which
the manifest's ``ipc.loaded`` marker tells the trainer). Generation pauses with ``mode="keep"`` around the load, and
the prefix cache (whose KV came from the old weights) is reset.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from asyncrl.inference.admin import checked_update
from asyncrl.inference.admin_routes import admin_router, backend, require_admin
from asyncrl.inference.errors import BadRequest
from asyncrl.inference.protocol import InitTransferRequest, UpdateWeightsRequest
from asyncrl.models.adapters import is_adapter_dir
from asyncrl.transport import ipc
from asyncrl.transport.nccl import read_manifest, update_info


class VLLMBackend:
    """``transport``: the config's ``weights.transport``; ``roots``: where ``/update_weights`` may load from
    (``None`` = anywhere); ``lora_base``: the model the server was started on with LoRA enabled (``model.lora``):
    policies are then adapters over it. vLLM's engine client is the app's ``state.engine_client``."""

    def __init__(self, transport: str, roots: list[Path] | None, lora_base: Path | None):
        self.transport, self.roots, self.lora_base = transport, roots, lora_base
        self.version = 0
        self.group: dict[str, Any] | None = None  # the NCCL group joined, once per server
        self.lock = asyncio.Lock()  # one update at a time

    async def pause(self, request: Request) -> None:
        await request.app.state.engine_client.pause_generation(mode="keep", clear_cache=False)

    async def resume(self, request: Request) -> None:
        await request.app.state.engine_client.resume_generation()

    async def update_weights(self, body: UpdateWeightsRequest, request: Request) -> dict[str, Any]:
        path = checked_update(body.path, body.version, self.version, self.roots, self.transport)
        manifest = read_manifest(path)
        shared = ipc.read_manifest(path) if self.transport == "ipc" else None
        if shared is not None and (why := ipc.manifest_problem(shared, body.version)):
            raise BadRequest(f"{path}: {why}")
        if manifest is not None and self.group is None:
            raise BadRequest("no NCCL group yet: POST /init_weight_transfer first", 409)
        if refusal := lora_refusal(path, self.lora_base):
            raise BadRequest(refusal[1], refusal[0])
        start, workers = time.perf_counter(), None
        async with self.lock:
            if (manifest is not None or shared is not None) and self.version >= body.version:
                # a retried request (its first try may have finished while this one waited for the lock): a version
                # sent GPU to GPU exists once; receiving it again would wait for a broadcast that never comes (nccl)
                # or read the trainer's buffer while it is being refilled (ipc)
                return {"version": self.version, "seconds": 0.0, "already_loaded": True}
            if shared is not None and (path / ipc.LOADED).is_file():
                raise BadRequest(
                    f"{path} was loaded before and the trainer's buffer may hold a newer policy by now; a sidecar "
                    "that restarted cannot load a version sent by weights.transport=ipc (resume from a checkpoint)",
                    409,
                )
            engine = request.app.state.engine_client
            await engine.pause_generation(mode="keep", clear_cache=False)
            try:
                workers = await self._load(request, path, manifest, shared, start)
                await engine.reset_prefix_cache(reset_running_requests=True)
            finally:
                await engine.resume_generation()
            self.version = body.version
        reply: dict[str, Any] = {"version": body.version, "seconds": time.perf_counter() - start}
        if workers:
            reply["workers"] = workers  # per worker: the reload mode used and its seconds
        return reply

    async def _load(self, request: Request, path: Path, manifest: Any, shared: Any, start: float) -> Any:
        """Load the policy at ``path`` by the way it arrived; the workers' reports, if they give any."""
        engine = request.app.state.engine_client
        if self.lora_base is not None:  # the policy is an adapter; the base weights never change
            await load_adapter(request.app.state.openai_serving_models, path)
        elif shared is not None:  # copy from the trainer's buffer, then free it for the next version
            reload = shared.get("reload", "direct")
            workers = await engine.collective_rpc("asyncrl_load_ipc", kwargs={"manifest": shared, "reload": reload})
            ipc.mark_loaded(path, time.perf_counter() - start)
            return workers
        elif manifest is None:
            await engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path.resolve())})
        else:  # one RPC: every worker receives and loads (asyncrl.inference.vllm.worker)
            reload = manifest.get("reload", "direct")
            kwargs = {"update_info": update_info(manifest), "reload": reload}
            return await engine.collective_rpc("asyncrl_receive_weights", kwargs=kwargs)
        return None


async def init_weight_transfer(
    body: InitTransferRequest, request: Request, served: Annotated[VLLMBackend, Depends(backend)]
) -> dict[str, Any]:
    if served.transport != "nccl":
        raise BadRequest("this server was not started with weights.transport=nccl", 409)
    if served.group is not None:
        raise BadRequest(f"already in an NCCL group ({served.group}); restart the server to join another", 409)
    info = body.model_dump()
    # blocks until the trainer and every other worker have joined
    await request.app.state.engine_client.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})
    served.group = info
    return {"group": info}


def build_router(
    admin_token: str | None,
    transport: str = "filesystem",
    roots: list[Path] | None = None,
    lora_base: Path | None = None,
) -> APIRouter:
    """The routes this backend adds to vLLM's app: the shared admin routes over a :class:`VLLMBackend`, and
    ``/init_weight_transfer``; the arguments are :class:`VLLMBackend`'s."""
    router = admin_router(VLLMBackend(transport, roots, lora_base), admin_token)
    router.add_api_route(
        "/init_weight_transfer", init_weight_transfer, methods=["POST"], dependencies=[Depends(require_admin)]
    )
    return router


def lora_refusal(path: Path, lora_base: Path | None) -> tuple[int, str] | None:
    """``(status, reason)`` when ``path`` cannot be loaded by a server in this LoRA mode (pure): an adapter on a
    server without LoRA, or full weights other than the base itself on one with it (vLLM 0.26 cannot reload
    weights into its LoRA-wrapped layers, and a LoRA run's base never changes)."""
    adapter = is_adapter_dir(path)
    if adapter and lora_base is None:
        return 400, f"{path} holds a LoRA adapter; this sidecar was not started with model.lora.enabled=true"
    if lora_base is not None and not adapter and path.resolve() != lora_base.resolve():
        return 409, (
            f"this sidecar serves LoRA adapters over {lora_base} (model.lora.enabled): {path} holds full weights, "
            "and only the base model itself (policy 0: the adapter unloaded) can be loaded"
        )
    return None


async def load_adapter(models: Any, path: Path) -> None:
    """Serve the LoRA adapter at ``path`` under the base model's own name, replacing the one loaded before
    in place: vLLM looks a request's ``model`` up among its adapters before its base models, so every request
    (the orchestrator's, a verifiers client's) gets the newest policy without knowing about LoRA. A full
    weights directory instead (policy 0, the base model) unloads the adapter. Raises a 400 with vLLM's reason
    when the adapter does not load."""
    # vLLM is GPU-only: the CPU install has none
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    name = models.base_model_paths[0].name
    if not is_adapter_dir(path):
        if name in models.lora_requests:
            await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        return
    answer = await models.load_lora_adapter(
        LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path.resolve()), load_inplace=name in models.lora_requests)
    )
    if not isinstance(answer, str):  # an ErrorResponse
        raise BadRequest(f"vLLM did not load the adapter at {path}: {answer.error.message}")
