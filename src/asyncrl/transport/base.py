"""A weight transport: how each new policy travels from the trainer to the sidecars, one class per way.

``weights.transport`` names a :class:`Transport` subclass through the registry
(:data:`asyncrl.config.variants.TRANSPORTS`): a built-in name (``filesystem``, ``nccl``, ``ipc``) or a user's
``package.module:Class``. The class carries everything that differs between transports, so that no other
module asks which transport it is: its config errors, its flags, and one hook for each process:

- the launcher: :meth:`Transport.prepare_launch` (e.g. pick a rendezvous port),
  :meth:`Transport.placed_rendezvous` (where a batch script puts it) and :meth:`Transport.process_needs`
  (distributions a process needs for it);
- the trainer: :meth:`Transport.publisher`, called once, whose ``publish`` makes policy N ``weights/step_N``;
- the orchestrator: :meth:`Transport.connect` (e.g. have the sidecars join the trainer's group at start);
- the vLLM sidecar: :meth:`Transport.vllm_args`, :meth:`Transport.refusal` and :meth:`Transport.vllm_load`
  for a ``weights/step_N`` holding the transport's :attr:`Transport.manifest` instead of safetensors, and in
  each of its workers :meth:`Transport.worker_load`, which asyncrl's worker extension
  (:mod:`asyncrl.inference.vllm.worker`) calls with the class's import path (:meth:`Transport.spec`).

Every transport keeps the step contract of :mod:`asyncrl.transport.weights`: the trainer publishes
``weights/step_N`` atomically, the orchestrator relays ``{path, version}`` with ``POST /update_weights``. A
*streamed* transport's versions exist only while a sidecar receives them (a broadcast, a shared buffer): each
must be loaded once, in order (``strict_async``), a sidecar that restarts cannot catch up, and versions that
a checkpoint needs on disk or that no sidecar will load go as files
(:func:`asyncrl.transport.streamed.sent_directly`).

This module and every transport's module are torch-free at import: the config checks, the launcher and the
orchestrator read them; the trainer's and the sidecar's hooks import torch and vLLM when called.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from asyncrl.config.variants import TRANSPORTS, overrides

if TYPE_CHECKING:
    from asyncrl.config import Config

RELOADS = ("direct", "layerwise")  # how a sidecar's worker loads a streamed policy (weights.reload)


class WeightPublisher(Protocol):
    def publish(self, version: int, path: Path) -> None:
        """Make the model's current weights policy ``version`` at ``path``; every trainer rank calls it, and
        it returns once the policy may change again."""


class Transport:
    """What every transport answers, with the defaults of one that publishes files; a subclass changes what
    differs. Class-level: a transport holds no state of its own (its publisher and the processes do)."""

    name: ClassVar[str] = ""
    # versions exist only while a sidecar receives them (see the module's docstring)
    streamed: ClassVar[bool] = False
    # the file a weights/step_N holds instead of safetensors (None: the transport publishes safetensors only)
    manifest: ClassVar[str | None] = None
    # whether a sidecar joins a group at start (POST /init_weight_transfer with a body :meth:`join_info`
    # reads, sent by :meth:`connect`)
    rendezvous: ClassVar[bool] = False
    # whether it carries a LoRA adapter's directory (model.lora: vLLM loads an adapter from its files)
    adapters: ClassVar[bool] = False
    # whether it reads settings of its own from ``weights.args`` (a user's transport; the built-ins' sections
    # are in the schema)
    takes_args: ClassVar[bool] = False

    @classmethod
    def missing_hooks(cls) -> list[str]:
        """The hooks this transport must define and does not: a publisher always, a worker's loader when it
        publishes a manifest (or a sidecar-side :meth:`vllm_load` of its own), a group's description when it
        has a rendezvous; the registry refuses such a class when the config is checked."""
        need = ["publisher", *(["join_info"] if cls.rendezvous else [])]
        if cls.manifest and not overrides(cls, Transport, "vllm_load"):
            need.append("worker_load")
        return [name for name in need if not overrides(cls, Transport, name)]

    @classmethod
    def spec(cls) -> str:
        """The class's ``package.module:Class`` path, which finds it again in a process that was handed only
        a string (a vLLM worker)."""
        return f"{cls.__module__}:{cls.__qualname__}"

    @classmethod
    def config_errors(cls, cfg: Config) -> list[str]:
        """Why ``cfg`` cannot use this transport (empty when it can): ``weights.args`` only for one that
        :attr:`takes_args`; one that publishes a manifest needs vLLM (the hf sidecar loads files only); a
        streamed one also a GPU trainer and ``strict_async``."""
        t, errors = cfg.weights.transport, []
        if (args := dict(cfg.weights.args)) and not cls.takes_args:
            errors.append(f"weights.args={args}: weights.transport={t} takes no args")
        if cls.manifest and cfg.inference.backend != "vllm":
            errors.append(
                f"weights.transport={t} needs inference.backend=vllm (got {cfg.inference.backend!r}); "
                f"the hf sidecar loads weights from files only: use weights.transport={TRANSPORTS.default}"
            )
        if not cls.streamed:
            return errors
        if cfg.trainer.fabric.accelerator == "cpu":
            errors.append(
                f"weights.transport={t} needs the trainer on CUDA: set trainer.fabric.accelerator=cuda"
            )
        if not cfg.strict_async:
            errors.append(
                f"weights.transport={t} needs strict_async=true: every version sent must be received, so "
                "the orchestrator must load every version in order"
            )
        return errors

    @classmethod
    def prepare_launch(cls, cfg: Config) -> None:
        """``asyncrl rl``, before it writes the run's config: fill in what the launcher chooses (ports)."""

    @classmethod
    def placed_rendezvous(cls, host: str, port: str) -> list[str]:
        """The overrides that put this transport's rendezvous at ``host:port``, for a launcher that places
        the processes itself (``asyncrl slurm multi_node``: the trainer's first node, a port per job; both
        may be shell expressions the script expands). Empty: it has none."""
        return []

    @classmethod
    def process_needs(cls, cfg: Config, process: str) -> dict[str, str]:
        """Distributions ``process`` ("trainer" or "inference") needs for this transport, each with the
        reason."""
        return {}

    @classmethod
    def publisher(cls, cfg: Config, fabric: Any, model: Any, tokenizer: Any) -> WeightPublisher:
        """The trainer's publisher for ``model`` (the raw model, not Fabric's wrapper), built once at start.
        (A transport that publishes files subclasses :class:`asyncrl.transport.files.Files`.)"""
        raise NotImplementedError(
            f"weights.transport={cfg.weights.transport}: the transport has no publisher"
        )

    @classmethod
    async def connect(cls, cfg: Config, pool: Any) -> None:
        """The orchestrator, at start and in the background: what the sidecars (``pool``, the orchestrator's
        :class:`asyncrl.rollouts.client.InferencePool`) must do before the first version arrives."""

    @classmethod
    def vllm_args(cls, cfg: Config) -> list[str]:
        """Arguments the vLLM sidecar starts with for this transport."""
        return []

    @classmethod
    def join_info(cls, body: dict[str, Any]) -> dict[str, Any]:
        """The vLLM sidecar, for a transport with :attr:`rendezvous`: the ``init_info`` of vLLM's
        ``init_weight_transfer_engine`` from a ``POST /init_weight_transfer`` body (what :meth:`connect`
        sends); a ``ValueError`` naming what is wrong with a body that describes no group (answered 422)."""
        raise NotImplementedError(f"weights.transport={cls.name} joins no group")

    @classmethod
    def read_manifest(cls, path: Path) -> dict[str, Any] | None:
        """This transport's manifest in ``path``, or ``None`` when ``path`` holds files to load."""
        f = path / cls.manifest if cls.manifest else None
        return json.loads(f.read_text()) if f is not None and f.is_file() else None

    @classmethod
    def manifest_problem(cls, manifest: dict[str, Any], version: int) -> str | None:
        """Why a sidecar must not load ``manifest`` as policy ``version`` (``None`` when it may): the columns
        vLLM's update reads, missing or of different lengths, or a reload mode it does not know."""
        need = ("names", "dtype_names", "shapes")
        if missing := [k for k in need if not isinstance(manifest.get(k), list)]:
            return f"the {cls.name} manifest lacks the lists {missing}"
        if len({len(manifest[k]) for k in need}) != 1:
            return f"the {cls.name} manifest's {', '.join(need)} differ in length"
        if manifest.get("reload", "direct") not in RELOADS:
            return f"reload={manifest['reload']!r}: expected one of {RELOADS}"
        return None

    @classmethod
    def refusal(cls, path: Path, joined: bool) -> tuple[int, str] | None:
        """The vLLM sidecar, holding its update lock with generation paused, before it loads the manifest in
        ``path`` (a version newer than the one it serves, which fits the served model): ``(status, reason)``
        when it must not; ``joined``: whether it joined a group (:attr:`rendezvous`)."""
        return None

    @classmethod
    async def vllm_load(cls, engine: Any, path: Path, manifest: dict[str, Any], timeout_s: float) -> Any:
        """The vLLM sidecar: load the policy ``manifest`` describes (``engine``: vLLM's engine client,
        generation paused); the workers' reports. By default one RPC in which every worker runs
        :meth:`worker_load` (``asyncrl_load`` of :mod:`asyncrl.inference.vllm.worker`), within
        ``timeout_s``."""
        kwargs = {"transport": cls.spec(), "manifest": manifest}
        return await asyncio.wait_for(engine.collective_rpc("asyncrl_load", kwargs=kwargs), timeout_s)

    @classmethod
    def worker_load(cls, worker: Any, model: Any, manifest: dict[str, Any], reload: str) -> set[str] | None:
        """In each of the vLLM sidecar's workers (``worker``: vLLM's GPU worker with asyncrl's extension,
        ``model``: the model it serves, generation paused): load the policy ``manifest`` describes, in
        ``reload`` mode (``direct``: into ``model.load_weights``; ``layerwise``: through vLLM's own reload
        lifecycle, :func:`asyncrl.inference.vllm.worker.reload_mode`). Returns the names of the parameters it
        loaded, which the extension checks are all of the model's, or ``None`` when vLLM's lifecycle loaded
        and checked them. Runs under vLLM: import torch and vLLM inside it."""
        raise NotImplementedError(f"weights.transport={cls.name} publishes no manifest")


def transport_of(cfg: Config) -> type[Transport]:
    """The class ``weights.transport`` names."""
    return TRANSPORTS.get(cfg.weights.transport)


def manifests() -> dict[str, str]:
    """Every known transport's manifest file name -> the transport's name."""
    return {t.manifest: t.name for t in TRANSPORTS.all() if t.manifest}
