"""``weights.transport=nccl``: the trainer broadcasts each new policy straight into the vLLM sidecars' GPUs.

vLLM 0.26's weight-transfer engine does the receiving (``--weight-transfer-config {"backend": "nccl"}``) in
:meth:`NCCL.worker_load`, which asyncrl's worker extension (:mod:`asyncrl.inference.vllm.worker`) runs in
each of the sidecar's workers; it loads in place by default.
The contract with the rest of asyncrl stays the step contract of :mod:`asyncrl.transport.weights`:

1. At start the trainer's rank 0 opens a rendezvous at ``weights.nccl.host:port`` (rank 0 of an
   NCCL group of ``1 + inference workers``); the orchestrator asks every sidecar to join it
   (``POST /init_weight_transfer``). Both calls block until the group is complete.
2. After step ``n`` the trainer publishes ``weights/step_{n+1}/`` holding only :data:`MANIFEST` (names,
   dtypes and shapes in send order), then broadcasts the tensors. The broadcast completes when the
   sidecars receive, so the trainer waits there until the orchestrator relays that version.
3. The orchestrator relays it exactly as a file-based version (``POST /update_weights {path, version}``);
   a sidecar that finds a manifest in ``path`` receives over NCCL instead of reading safetensors.

Every broadcast must be matched by a receive, so versions that the orchestrator may never load (the last
``async_level + 1``) or must reload from disk on resume (those checkpoints protect) are written as
safetensors instead (:func:`asyncrl.transport.streamed.sent_directly`). That, and a one-to-one relay of
versions, needs ``strict_async=true`` (:meth:`NCCL.config_errors`).

What is sent is the trainer's state dict as it is (:func:`asyncrl.transport.weights.export_items`), a mixture
of experts included: transformers' fused ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate
rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]`` are the fused layout vLLM 0.26's MoE
loader reads besides the per-expert one (``RoutedExperts.load_weights`` in
``vllm/model_executor/layers/fused_moe/routed_experts.py``: a 3-D tensor is split per expert,
``gate_up_proj`` halved along dim 1 into gate and up), so a layer's experts go as two tensors rather than
``3 E``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.config.layout import gpu_list, inference_workers, parallel_sizes
from asyncrl.transport.base import Transport
from asyncrl.transport.files import Files
from asyncrl.transport.streamed import StreamedOrFiles, export_entries, manifest_columns
from asyncrl.utils.atomic import atomic_dir

# torch-free at import: config checks, the launcher and the sidecar's HTTP side read this module's constants
# and manifests; the trainer's functions below import torch and vLLM (GPU-only) when called
if TYPE_CHECKING:
    import torch

    from asyncrl.config import Config

MANIFEST = "nccl.json"

log = logging.getLogger("asyncrl.trainer")


class NCCL(Transport):
    """GPU to GPU by NCCL broadcast into vLLM's weight-transfer engine (see the module's docstring)."""

    name = "nccl"
    streamed = True
    manifest = MANIFEST
    rendezvous = True

    @classmethod
    def config_errors(cls, cfg: Config) -> list[str]:
        errors = super().config_errors(cfg)
        shared = set(gpu_list(cfg.trainer.fabric.gpus)) & {
            g for e in cfg.inference.gpus for g in gpu_list(e)
        }
        if shared:
            errors.append(
                "weights.transport=nccl cannot link processes on the same GPU "
                f"(GPU {', '.join(sorted(shared))} "
                f"is in both trainer.fabric.gpus and inference.gpus): use weights.transport={Files.name}"
            )
        try:
            sizes = parallel_sizes(list(cfg.inference.vllm.extra_args))
        except ValueError:
            sizes = {"pp": 1, "dp": 1}  # layout_errors names the bad flag
        if sizes["pp"] * sizes["dp"] > 1:
            errors.append(
                "weights.transport=nccl counts the workers that join its group as sidecars x "
                "inference.tensor_parallel; with data or pipeline parallelism in inference.vllm.extra_args "
                f"use weights.transport={Files.name}"
            )
        return errors

    @classmethod
    def prepare_launch(cls, cfg: Config) -> None:
        from asyncrl.utils.process import free_port  # lazy: only the launcher picks ports

        if not cfg.weights.nccl.port:
            cfg.weights.nccl.port = free_port(cfg.weights.nccl.host)  # the trainer's rendezvous

    @classmethod
    def placed_rendezvous(cls, host: str, port: str) -> list[str]:
        return [f"weights.nccl.host={host}", f"weights.nccl.port={port}"]

    @classmethod
    def process_needs(cls, cfg: Config, process: str) -> dict[str, str]:
        why = "weights.transport=nccl: the trainer sends through vLLM's NCCL weight-transfer engine"
        return {"vllm": why} if process == "trainer" else {}

    @classmethod
    def publisher(cls, cfg: Config, fabric: Any, model: Any, tokenizer: Any) -> StreamedOrFiles:
        return StreamedOrFiles(
            cfg, NCCLPublisher(cfg, fabric, model), Files.publisher(cfg, fabric, model, tokenizer)
        )

    @classmethod
    async def connect(cls, cfg: Config, pool: Any) -> None:
        """Every sidecar joins the trainer's group (once the trainer opens it; steps on policy 0 go on
        meanwhile): server ``i``'s workers are ranks ``1 + i * per_server ..`` (the trainer is 0)."""
        world, (host, port) = 1 + inference_workers(cfg), (cfg.weights.nccl.host, cfg.weights.nccl.port)
        per_server = (world - 1) // len(pool.urls)
        await pool.join_group(
            [
                {
                    "master_address": host,
                    "master_port": port,
                    "rank_offset": 1 + i * per_server,
                    "world_size": world,
                }
                for i in range(len(pool.urls))
            ]
        )

    @classmethod
    def vllm_args(cls, cfg: Config) -> list[str]:
        return ["--weight-transfer-config", '{"backend": "nccl"}']

    @classmethod
    def join_info(cls, body: dict[str, Any]) -> dict[str, Any]:
        return JoinGroup.model_validate(body).model_dump()

    @classmethod
    def refusal(cls, path: Path, joined: bool) -> tuple[int, str] | None:
        return None if joined else (409, "no NCCL group yet: POST /init_weight_transfer first")

    @classmethod
    def worker_load(cls, worker: Any, model: Any, manifest: dict[str, Any], reload: str) -> set[str] | None:
        """Receive the broadcast the manifest describes: through vLLM's layerwise lifecycle, or each bucket
        straight into ``model.load_weights`` (:func:`receive_direct`)."""
        if worker.weight_transfer_engine is None:
            raise RuntimeError(
                "the server was not started with a weight-transfer config (NCCL.vllm_args was not applied)"
            )
        info = update_info(manifest)
        if reload == "layerwise":
            worker.start_weight_update()
            worker.update_weights(info)
            worker.finish_weight_update()
            return None
        return receive_direct(worker.weight_transfer_engine, model, info)


class NCCLPublisher:
    """The manifest in ``path``, then one broadcast into the sidecars' GPUs."""

    def __init__(self, cfg: Config, fabric, model: torch.nn.Module):
        from asyncrl.models.hf import TORCH_DTYPES  # lazy: torch

        log.info(
            "opening the NCCL group at "
            f"{cfg.weights.nccl.host}:{cfg.weights.nccl.port} (waits for the sidecars)"
        )
        self.rank0, self.model, self.reload = fabric.global_rank == 0, model, cfg.weights.reload
        self.dtype = TORCH_DTYPES[cfg.model.dtype]
        self.sender = NCCLSender(cfg, fabric.global_rank)
        self.entries = export_entries(model, self.dtype)

    def publish(self, version: int, path: Path) -> None:
        if self.rank0:  # manifest first: the orchestrator's relay starts the receive
            write_manifest(path, self.entries, version, self.reload)
        self.sender.send(self.model, self.dtype)  # returns once the sidecars have it


# -- rendezvous and manifest ----------------------------------------------------------------------------


class JoinGroup(BaseModel):
    """A sidecar's ``POST /init_weight_transfer`` body: the trainer's NCCL group to join (vLLM's
    ``NCCLWeightTransferInitInfo``)."""

    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(
        min_length=1, pattern=r"^[^\x00]*$", description="the trainer's rendezvous host"
    )
    master_port: int = Field(ge=1, le=65535, description="the trainer's rendezvous port")
    rank_offset: int = Field(ge=1, description="group rank of this server's first worker (the trainer is 0)")
    world_size: int = Field(ge=2, description="the trainer plus every inference worker")

    @model_validator(mode="after")
    def _fits(self):
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset={self.rank_offset} must be < world_size={self.world_size}")
        return self


def write_manifest(
    path: Path, entries: list[tuple[str, str, list[int]]], version: int, reload: str = "direct"
) -> None:
    """Publish ``path`` (a ``weights/step_N`` directory) holding only the manifest, atomically. ``reload``:
    how the sidecars' workers load what they receive (``weights.reload``; see inference/vllm/worker.py)."""
    manifest = {"version": version, **manifest_columns(entries), "reload": reload}
    with atomic_dir(path) as tmp:
        (tmp / MANIFEST).write_text(json.dumps(manifest))


def update_info(manifest: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` fields for a manifest (packed: one broadcast per ~1 GB)."""
    return {
        "names": manifest["names"],
        "dtype_names": manifest["dtype_names"],
        "shapes": manifest["shapes"],
        "packed": True,
    }


# -- sidecar side: in each vLLM worker ------------------------------------------------------------------


def receive_direct(engine: Any, model: Any, update_info: dict[str, Any]) -> set[str]:
    """Receive one packed broadcast through vLLM's consumer, each bucket straight into
    ``model.load_weights``; returns the names of the parameters it loaded."""
    # lazy: runs in vLLM's workers (torch; vLLM is GPU-only, the CPU install has none)
    import torch
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


# -- trainer side --------------------------------------------------------------------------------------


def iter_export(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights, one GPU tensor at a time in ``dtype`` (a collective under FSDP2: every rank iterates
    in lockstep, gathering bucket by bucket; only rank 0's tensors are sent)."""
    # lazy: torch; the orchestrator imports this module without it
    from asyncrl.transport.gather import iter_full

    yield from iter_full(model, dtype)


class NCCLSender:
    """The trainer's end of the group (rank 0 of the trainer only; other ranks pass ``group=None``)."""

    def __init__(self, cfg: Config, rank: int):
        self.group = None
        if rank == 0:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            if not cfg.weights.nccl.port:
                raise ValueError(
                    "weights.nccl.port=0: `asyncrl rl` picks one; set it when you start "
                    "`asyncrl train` and `asyncrl orchestrate` yourself"
                )
            self.group = NCCLWeightTransferEngine.trainer_init(
                {
                    "master_address": cfg.weights.nccl.host,
                    "master_port": cfg.weights.nccl.port,
                    "world_size": 1 + inference_workers(cfg),
                }
            )

    def send(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        """Broadcast the weights (every trainer rank calls this: the gathers are collectives, bucket by
        bucket, so rank 0 never holds the whole model); returns once the sidecars have them."""
        import torch  # lazy: the orchestrator imports this module without torch

        items = iter_export(model, dtype)
        if self.group is None:
            for _ in items:  # drive the all-gathers that rank 0's iteration needs
                pass
            return
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        NCCLWeightTransferEngine.trainer_send_weights(items, {"group": self.group, "packed": True})
        torch.cuda.synchronize()
