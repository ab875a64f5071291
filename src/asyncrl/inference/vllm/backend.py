"""The vLLM backend's answers to the shared admin routes (:class:`asyncrl.inference.admin_routes.Backend`),
and ``POST /init_weight_transfer`` (joining the group of a transport with a rendezvous), which only this
backend serves.

A policy arrives as a safetensors directory (``collective_rpc("reload_weights")``, in place, no restart), a
LoRA adapter directory (``model.lora``: loaded as vLLM's adapter under the served model's name,
:func:`load_adapter`), or a directory holding the manifest of a transport that sends the weights itself (a
broadcast, a buffer on the same GPU), which the transport loads
(:meth:`asyncrl.transport.base.Transport.vllm_load`). Generation pauses with ``mode="keep"`` around the load,
and the prefix cache (whose KV came from the old weights) is reset.

An update is all or nothing. Before any parameter changes, what it would load (the files' headers, or the
manifest's columns) is read and checked: against the model the server started from
(:mod:`asyncrl.inference.vllm.weights_check`), then by every worker loading it on the meta device
(:func:`asyncrl.inference.vllm.worker.dry_run_problems`). What does not fit is answered 400 with the reason,
and the served policy is untouched. A load that fails after the checks (a transfer cut half-way, a file
removed meanwhile) reloads the files of the served version where they exist, else the sidecar stops serving:
generation stays paused and the process ends, so no request is answered by a mix of two policies. A
transport's load that has not finished within ``receive_timeout_s`` is such a failure too: a trainer that
died half-way through a broadcast leaves the workers waiting for the rest, and only ending the process frees
them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request

from asyncrl.inference.admin import checked_update
from asyncrl.inference.admin_routes import admin_router, backend, require_admin
from asyncrl.inference.errors import BadRequest
from asyncrl.inference.protocol import UpdateWeightsRequest
from asyncrl.inference.recording import Rollouts
from asyncrl.inference.vllm.weights_check import (
    Entry,
    directory_entries,
    manifest_entries,
    reference_entries,
    signature_problems,
)
from asyncrl.models.adapters import is_adapter_dir
from asyncrl.transport.base import Transport

log = logging.getLogger("asyncrl.inference")


class VLLMBackend:
    """``transport``: the class ``weights.transport`` names; ``roots``: where ``/update_weights`` may load
    from (``None`` = anywhere); ``lora_base``: the model the server was started on with LoRA enabled
    (``model.lora``): policies are then adapters over it; ``served``: the model the server started from;
    ``receive_timeout_s``: how long a transport's load (a broadcast) may take (the orchestrator's request
    timeout: its client gives up then too). vLLM's engine client is the app's ``state.engine_client``."""

    STOP_AFTER_S = 1.0
    EXIT_AFTER_S = 15.0

    def __init__(
        self,
        transport: type[Transport],
        roots: list[Path] | None,
        lora_base: Path | None,
        served: str | Path | None = None,
        receive_timeout_s: float = 600.0,
    ):
        self.transport, self.roots, self.lora_base = transport, roots, lora_base
        self.receive_timeout_s = receive_timeout_s
        self.version = 0
        # the group joined (a transport with a rendezvous), once per server
        self.group: dict[str, Any] | None = None
        self.lock = asyncio.Lock()  # one update at a time
        # what updates are checked against: the model the server started from (policy 0), when it is a
        # directory
        start = Path(served) if served is not None and lora_base is None else None
        self.reference = reference_entries(start) if start is not None else None
        # the files of the last version loaded from files (to restore it after a failed load); policy 0: the
        # model
        self.last_files = (start, 0) if start is not None and self.reference is not None else None
        self.broken = ""  # why this sidecar stopped serving, once an update left mixed weights

    async def pause(self, request: Request) -> None:
        await request.app.state.engine_client.pause_generation(mode="keep", clear_cache=False)

    async def resume(self, request: Request) -> None:
        await request.app.state.engine_client.resume_generation()

    async def update_weights(self, body: UpdateWeightsRequest, request: Request) -> dict[str, Any]:
        path = checked_update(body.path, body.version, self.version, self.roots, self.transport)
        manifest = self.transport.read_manifest(path)  # None: files to load
        if manifest is not None and (why := self.transport.manifest_problem(manifest, body.version)):
            raise BadRequest(f"{path}: {why}")
        if refusal := lora_refusal(path, self.lora_base):
            raise BadRequest(refusal[1], refusal[0])
        # with LoRA nothing but adapters is loaded (the base itself unloads the adapter; lora_refusal turns
        # other full weights away), and a dry run of full weights' names would fail on vLLM's LoRA-wrapped
        # layers (their weights are named ``<layer>.base_layer.weight``)
        lora = self.lora_base is not None
        entries = None if lora or is_adapter_dir(path) else update_entries(path, manifest, self.reference)
        start, workers = time.perf_counter(), None
        async with self.lock:
            if self.broken:
                raise BadRequest(self.broken, 503)
            if manifest is not None and self.version >= body.version:
                # a retried request (its first try may have finished while this one waited for the lock): a
                # version a transport sent itself exists once; receiving it again would wait for a broadcast
                # that never comes or read a trainer's buffer while it is being refilled
                return {"version": self.version, "seconds": 0.0, "already_loaded": True}
            engine = request.app.state.engine_client
            await engine.pause_generation(mode="keep", clear_cache=False)
            try:
                if entries is not None and (problems := await self._check(engine, entries)):
                    raise BadRequest(
                        f"{path} does not fit the served model: {'; '.join(problems)}", param="path"
                    )
                # after the fit check: a manifest that does not fit is a 400 whatever the transport's state
                if manifest is not None and (
                    refusal := self.transport.refusal(path, self.group is not None)
                ):
                    raise BadRequest(refusal[1], refusal[0])
                try:
                    workers = await self._load(request, path, manifest)
                except BadRequest:  # vLLM refused a LoRA adapter before loading it
                    raise
                # after the checks: a transfer cut, a file gone, a bug; the weights may be mixed
                except Exception as e:
                    await self._recover(engine, path, e)
                await engine.reset_prefix_cache(reset_running_requests=True)
            finally:
                if not self.broken:  # a sidecar serving mixed weights stays paused until it stops
                    await engine.resume_generation()
            self.version = body.version
            if manifest is None and entries is not None:
                self.last_files = (path, body.version)
        reply: dict[str, Any] = {"version": body.version, "seconds": time.perf_counter() - start}
        if workers:
            reply["workers"] = workers  # per worker: the reload mode used and its seconds
        return reply

    async def _check(self, engine: Any, entries: list) -> list[str]:
        """Every worker's :func:`asyncrl.inference.vllm.worker.dry_run_problems` for ``entries``, once
        each."""
        found = await engine.collective_rpc("asyncrl_check_weights", kwargs={"entries": entries})
        return list(dict.fromkeys(p for worker in found for p in worker))

    async def _recover(self, engine: Any, path: Path, error: Exception) -> None:
        """After a load that failed part-way: reload the files of the served version if there are any, else
        stop serving (generation stays paused, the process ends: the launcher or a load balancer sees it go).
        Raises a 503 saying which it was."""
        what = f"loading {path} failed after its checks ({type(error).__name__}: {error})"
        # the workers still wait inside the transfer: no other call reaches them
        if isinstance(error, TimeoutError):
            timeout_s = self.receive_timeout_s
            what = f"the transfer of {path} did not finish in {timeout_s:.0f} s (a sender gone half-way?)"
        elif self.last_files is not None and self.last_files[1] == self.version:
            good = self.last_files[0]
            try:
                await engine.collective_rpc("reload_weights", kwargs={"weights_path": str(good.resolve())})
            except Exception as again:  # noqa: BLE001 - any failure here leaves mixed weights: stop serving
                what += f"; restoring {good} failed too ({type(again).__name__}: {again})"
            else:
                log.error(f"{what}; restored policy {self.version} from {good}")
                raise BadRequest(f"{what}; policy {self.version} restored from {good}", 503) from None
        self.broken = f"{what}: the served weights may mix two policies; this sidecar stops serving"
        log.critical(self.broken)
        # once this answer has gone out
        asyncio.get_running_loop().call_later(self.STOP_AFTER_S, self.stop_serving)
        raise BadRequest(self.broken, 503) from None

    def stop_serving(self) -> None:
        """End the server as a stop request would (vLLM shuts its engine down on SIGTERM); exit
        :data:`EXIT_AFTER_S` later if vLLM's shutdown still waits then (for requests open when the engine
        stopped, which it never answers: measured by tests/gpu/test_vllm_update_refusals.py)."""
        os.kill(os.getpid(), signal.SIGTERM)
        timer = threading.Timer(self.EXIT_AFTER_S, exit_now, args=(self.EXIT_AFTER_S,))
        timer.daemon = True  # a shutdown that finishes first ends the process without waiting for it
        timer.start()

    async def _load(self, request: Request, path: Path, manifest: dict[str, Any] | None) -> Any:
        """Load the policy at ``path`` by the way it arrived; the workers' reports, if they give any."""
        engine = request.app.state.engine_client
        if self.lora_base is not None:  # the policy is an adapter; the base weights never change
            await load_adapter(request.app.state.openai_serving_models, path)
        elif manifest is None:
            await engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path.resolve())})
        else:  # as its transport sends it (a broadcast, a shared buffer)
            return await self.transport.vllm_load(engine, path, manifest, self.receive_timeout_s)
        return None


def exit_now(waited_s: float) -> None:
    """The process's end when a graceful shutdown hangs (vLLM has stopped the engine's processes by then)."""
    log.critical(f"vLLM's shutdown still waits for open requests after {waited_s:.0f} s: exiting")
    logging.shutdown()
    os._exit(70)


async def init_weight_transfer(
    body: Annotated[dict[str, Any], Body()],
    request: Request,
    served: Annotated[VLLMBackend, Depends(backend)],
) -> dict[str, Any]:
    """Join the weight-transfer group ``body`` describes, as the server's transport reads it
    (:meth:`asyncrl.transport.base.Transport.join_info`)."""
    if not served.transport.rendezvous:
        raise BadRequest(f"this server's weights.transport={served.transport.name} joins no group", 409)
    if served.group is not None:
        raise BadRequest(f"already in a group ({served.group}); restart the server to join another", 409)
    try:
        info = served.transport.join_info(body)
    except ValueError as e:  # pydantic's ValidationError included
        raise BadRequest(f"not a group to join: {e}", 422) from None
    # blocks until the trainer and every other worker have joined
    await request.app.state.engine_client.collective_rpc(
        "init_weight_transfer_engine", kwargs={"init_info": info}
    )
    served.group = info
    return {"group": info}


def build_router(
    admin_token: str | None,
    transport: type[Transport] = Transport,
    roots: list[Path] | None = None,
    lora_base: Path | None = None,
    served: str | Path | None = None,
    receive_timeout_s: float = 600.0,
    rollouts: Rollouts | None = None,
) -> APIRouter:
    """The routes this backend adds to vLLM's app: the shared admin routes over a :class:`VLLMBackend`, and
    ``/init_weight_transfer``; the arguments are :class:`VLLMBackend`'s, and ``rollouts``: the rollout-scoped
    endpoints' record (:mod:`asyncrl.inference.recording`), if the app serves them."""
    vllm_backend = VLLMBackend(transport, roots, lora_base, served, receive_timeout_s)
    if rollouts is not None:
        rollouts.version = lambda: vllm_backend.version
    router = admin_router(vllm_backend, admin_token, rollouts)
    router.add_api_route(
        "/init_weight_transfer",
        init_weight_transfer,
        methods=["POST"],
        dependencies=[Depends(require_admin)],
    )
    return router


def lora_refusal(path: Path, lora_base: Path | None) -> tuple[int, str] | None:
    """``(status, reason)`` when ``path`` cannot be loaded by a server in this LoRA mode (pure): an adapter
    on a server without LoRA, or full weights other than the base itself on one with it (vLLM 0.26 cannot
    reload weights into its LoRA-wrapped layers, and a LoRA run's base never changes)."""
    adapter = is_adapter_dir(path)
    if adapter and lora_base is None:
        return 400, f"{path} holds a LoRA adapter; this sidecar was not started with model.lora.enabled=true"
    if lora_base is not None and not adapter and path.resolve() != lora_base.resolve():
        return 409, (
            f"this sidecar serves LoRA adapters over {lora_base} "
            f"(model.lora.enabled): {path} holds full weights, "
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
        LoadLoRAAdapterRequest(
            lora_name=name, lora_path=str(path.resolve()), load_inplace=name in models.lora_requests
        )
    )
    if not isinstance(answer, str):  # an ErrorResponse
        raise BadRequest(f"vLLM did not load the adapter at {path}: {answer.error.message}")


def update_entries(
    path: Path, manifest: dict[str, Any] | None, reference: dict[str, Entry] | None
) -> list[Entry]:
    """What the update at ``path`` would load (a manifest's columns, else its files' headers), checked
    against the starting model's ``reference``; :class:`BadRequest` (400) naming what cannot be read or does
    not fit."""
    try:
        entries = manifest_entries(manifest) if manifest is not None else directory_entries(path)
    except (OSError, ValueError) as e:
        raise BadRequest(f"cannot load weights from {path}: {e}", param="path") from None
    if problems := signature_problems(entries, reference):
        raise BadRequest(f"{path} does not fit the served model: {'; '.join(problems[:5])}", param="path")
    return entries
