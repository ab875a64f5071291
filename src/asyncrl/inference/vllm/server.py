"""The vLLM backend (``inference.backend=vllm``): vLLM's own OpenAI server, with asyncrl's routes added.

Serving is entirely vLLM's (``/v1/chat/completions`` with ``return_token_ids`` and logprobs, continuous
batching, prefix caching, CUDA graphs). We only add, on the same app:

- ``POST /update_weights {"path", "version"}``: pause, ``collective_rpc("reload_weights")`` from the
  safetensors directory in place (no restart), reset the prefix cache (its KV came from the old
  weights), resume, and record the version; a LoRA adapter directory (``model.lora``) is loaded as vLLM's
  LoRA adapter, in place, under the served model's name (:func:`load_adapter`);
- ``POST /pause``, ``POST /resume`` (``pause_generation(mode="keep")`` freezes in-flight requests);
- ``GET /policy``: the version being served;
- with ``weights.transport=nccl``: ``POST /init_weight_transfer`` joins the trainer's NCCL group, and
  ``/update_weights`` given a directory holding a transfer manifest receives the broadcast through vLLM's
  weight-transfer engine instead of reading files (see transport/nccl.py), in one RPC to asyncrl's worker
  extension (inference/vllm_worker.py: straight into the parameters, or vLLM's layerwise reload);
- with ``weights.transport=ipc``: a directory holding an IPC manifest is copied from the trainer's GPU buffer
  (transport/ipc.py), after which the route writes the manifest's ``ipc.loaded`` marker for the trainer.

One change to a route of vLLM's: a non-streaming ``/inference/v1/generate`` request (verifiers' token route)
returns only its final output (:func:`final_only_unless_streamed`).

Logprobs are ``processed_logprobs`` (after temperature and top-p), as the trainer's importance ratio needs.
Admin routes answer loopback clients only unless ``inference.admin_token`` is set. vLLM's own dev-mode
routes of the same names stay off (``VLLM_SERVER_DEV_MODE`` unset), so ours are the ones served.
Written against vLLM 0.26.0 (``vllm.entrypoints.openai.api_server``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from asyncrl.config import Config
from asyncrl.inference.admin import admin_refusal, update_refusal, weights_problem, weights_roots
from asyncrl.inference.protocol import InitTransferRequest, UpdateWeightsRequest
from asyncrl.models.lora import is_adapter_dir
from asyncrl.transport import ipc
from asyncrl.transport.nccl import STREAMED, read_manifest, update_info

log = logging.getLogger("asyncrl.inference")


# numerics=bitwise: no Inductor, every op vLLM's own kernel, CUDA graphs for decode steps
BITWISE_COMPILATION = '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["all"]}'


def vllm_cli_args(cfg: Config, port: int) -> list[str]:
    """The ``vllm serve`` arguments for this config (pure function)."""
    v = cfg.inference.vllm
    bitwise = cfg.numerics == "bitwise"
    args = [
        cfg.model.name,
        "--host",
        cfg.inference.host,
        "--port",
        str(port),
        "--served-model-name",
        cfg.model.name,
        "--dtype",
        cfg.model.dtype,
        "--seed",
        str(cfg.seed),
        "--logprobs-mode",
        "processed_logprobs",
        "--gpu-memory-utilization",
        str(v.gpu_memory_utilization),
        "--max-num-seqs",
        str(v.max_num_seqs),
        "--uvicorn-log-level",
        cfg.inference.log_level,
    ]
    if cfg.model.tokenizer:
        args += ["--tokenizer", cfg.model.tokenizer]
    if cfg.model.trust_remote_code:
        args.append("--trust-remote-code")
    if v.enforce_eager:
        args.append("--enforce-eager")
    if bitwise:
        # what asyncrl.models.bitwise reproduces (VLLM_BATCH_INVARIANT=1 comes from asyncrl.numerics, the residual
        # RMSNorm from asyncrl's vLLM plugin): the Triton attention kernel and vLLM's eager ops, which CUDA graphs
        # replay as they are; Inductor (compilation mode 3) fuses them into other roundings (measured:
        # benchmarks/bitwise_probe.py, eager and graphs 3,072/3,072 bit-equal, compiled 0)
        if not v.enforce_eager:
            args += ["--compilation-config", BITWISE_COMPILATION]
        args += ["--attention-backend", "TRITON_ATTN"]
    if v.max_model_len:
        args += ["--max-model-len", str(v.max_model_len)]
    if not v.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    if cfg.weights.transport == "nccl":
        args += ["--weight-transfer-config", '{"backend": "nccl"}']
    if cfg.weights.transport in STREAMED:
        from asyncrl.inference.vllm_worker import EXTENSION

        args += ["--worker-extension-cls", EXTENSION]
    if cfg.model.lora.enabled:  # one adapter slot: each policy replaces the last in place
        from asyncrl.models.lora import vllm_max_rank

        args += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(vllm_max_rank(cfg.model.lora.r))]
        # only the layers the trainer adapts get vLLM's LoRA wrappers: none on lm_head (a wasted vocab-sized
        # matmul per token, and vLLM 0.26's warm-up adapter for it fails on a vocabulary under 256)
        args += ["--lora-target-modules", *cfg.model.lora.target_modules]
    return args + list(v.extra_args)


def prepare_plugin(cfg: Config) -> None:
    """Before vLLM starts: refuse when the config needs asyncrl's vLLM plugin and vLLM would not load it, and set
    the plugin's switches in the environment, which vLLM's engine-core process inherits."""
    # without the plugin the sidecar's logprobs would silently differ from the trainer's (bitwise), or its speed-up
    # would silently not happen (defer_logprobs)
    needs_plugin = []
    if cfg.numerics == "bitwise":
        needs_plugin.append("numerics=bitwise")
    if cfg.inference.vllm.defer_logprobs:
        needs_plugin.append("inference.vllm.defer_logprobs=true")
    if needs_plugin:
        from asyncrl.inference.vllm_plugin import plugin_problem

        if problem := plugin_problem():
            raise RuntimeError(f"{' and '.join(needs_plugin)}: {problem}")
    from asyncrl.inference.vllm_logprobs import ENV

    # the config decides, not an inherited environment: vLLM's engine-core process inherits this one's
    os.environ.pop(ENV, None)
    if cfg.inference.vllm.defer_logprobs:
        os.environ[ENV] = "1"


def build_router(
    admin_token: str | None,
    transport: str = "filesystem",
    roots: list[Path] | None = None,
    lora_base: Path | None = None,
) -> APIRouter:
    """Our routes; ``transport``: the config's ``weights.transport`` (``nccl``: the server was started with vLLM's
    NCCL weight-transfer engine; ``ipc``: policies arrive as CUDA IPC handles of the trainer's buffer); ``roots``: where
    ``/update_weights`` may load from (``None`` = anywhere); ``lora_base``: the model the server was started
    on with LoRA enabled (``model.lora``): policies are then adapters over it."""
    # (request annotations must resolve at module level: FastAPI reads them from the module's globals)
    router = APIRouter()
    lock = asyncio.Lock()
    state: dict[str, Any] = {"version": 0, "group": None}

    def guard(request: Request) -> None:
        refusal = admin_refusal(request.client.host if request.client else None, request.headers, admin_token)
        if refusal:
            raise HTTPException(403, refusal)

    @router.get("/policy")
    async def policy() -> dict:
        return {"version": state["version"]}

    @router.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest, request: Request) -> dict:
        guard(request)
        path = Path(body.path)
        if roots is not None and (refusal := update_refusal(path, body.version, state["version"], roots)):
            raise HTTPException(*refusal)
        if problem := weights_problem(path, transport):
            raise HTTPException(problem[0], problem[1])
        manifest = read_manifest(path)
        shared = ipc.read_manifest(path) if transport == "ipc" else None
        if shared is not None and (why := ipc.manifest_problem(shared, body.version)):
            raise HTTPException(400, f"{path}: {why}")
        if manifest is not None and state["group"] is None:
            raise HTTPException(409, "no NCCL group yet: POST /init_weight_transfer first")
        if refusal := lora_refusal(path, lora_base):
            raise HTTPException(*refusal)
        engine = request.app.state.engine_client
        start, workers = time.perf_counter(), None
        async with lock:  # one update at a time
            if (manifest is not None or shared is not None) and state["version"] >= body.version:
                # a retried request (its first try may have finished while this one waited for the lock): a version
                # sent GPU to GPU exists once; receiving it again would wait for a broadcast that never comes (nccl)
                # or read the trainer's buffer while it is being refilled (ipc)
                return {"version": state["version"], "seconds": 0.0, "already_loaded": True}
            if shared is not None and (path / ipc.LOADED).is_file():
                raise HTTPException(
                    409,
                    f"{path} was loaded before and the trainer's buffer may hold a newer policy by now; a sidecar "
                    "that restarted cannot load a version sent by weights.transport=ipc (resume from a checkpoint)",
                )
            await engine.pause_generation(mode="keep", clear_cache=False)
            try:
                if lora_base is not None:  # the policy is an adapter; the base weights never change
                    await load_adapter(request.app.state.openai_serving_models, path)
                elif shared is not None:  # copy from the trainer's buffer, then free it for the next version
                    workers = await engine.collective_rpc(
                        "asyncrl_load_ipc", kwargs={"manifest": shared, "reload": shared.get("reload", "direct")}
                    )
                    ipc.mark_loaded(path, time.perf_counter() - start)
                elif manifest is None:
                    await engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path.resolve())})
                else:  # one RPC: every worker receives and loads (inference/vllm_worker.py)
                    workers = await engine.collective_rpc(
                        "asyncrl_receive_weights",
                        kwargs={"update_info": update_info(manifest), "reload": manifest.get("reload", "direct")},
                    )
                await engine.reset_prefix_cache(reset_running_requests=True)
            finally:
                await engine.resume_generation()
            state["version"] = body.version
        reply = {"version": body.version, "seconds": time.perf_counter() - start}
        if workers:
            reply["workers"] = workers  # per worker: the reload mode used and its seconds
        return reply

    @router.post("/init_weight_transfer")
    async def init_weight_transfer(body: InitTransferRequest, request: Request) -> dict:
        guard(request)
        if transport != "nccl":
            raise HTTPException(409, "this server was not started with weights.transport=nccl")
        if state["group"] is not None:
            raise HTTPException(409, f"already in an NCCL group ({state['group']}); restart the server to join another")
        info = body.model_dump()
        # blocks until the trainer and every other worker have joined
        await request.app.state.engine_client.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})
        state["group"] = info
        return {"group": info}

    @router.post("/pause")
    async def pause(request: Request) -> dict:
        guard(request)
        await request.app.state.engine_client.pause_generation(mode="keep", clear_cache=False)
        return {"paused": True}

    @router.post("/resume")
    async def resume(request: Request) -> dict:
        guard(request)
        await request.app.state.engine_client.resume_generation()
        return {"paused": False}

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
    weights directory instead (policy 0, the base model) unloads the adapter. Raises HTTPException 400 with
    vLLM's reason when the adapter does not load."""
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
        raise HTTPException(400, f"vLLM did not load the adapter at {path}: {answer.error.message}")


def final_only_unless_streamed(request: Any) -> None:
    """Make a non-streaming ``/inference/v1/generate`` request (vLLM's ``GenerateRequest``) final-only, as vLLM's
    OpenAI routes make theirs, unless its ``sampling_params`` asked for another output kind than the default.

    vLLM 0.26 leaves the token route at ``SamplingParams``' default, ``CUMULATIVE``, and answers with the last
    output the engine streamed. With ``n > 1``, once one sample has finished the later outputs hold only the
    others, so a sample that finished early was missing from the answer (seen on an H100: ``n=2`` answered one
    choice, index 1). Final-only, the answer waits for all ``n``; and the request's logprobs can be deferred
    (``inference.vllm.defer_logprobs``, which applies to final-only requests)."""
    sp = request.sampling_params
    if request.stream or request.is_sampling_param_provided("output_kind"):
        return
    if getattr(sp.output_kind, "name", None) == "CUMULATIVE":  # vllm.sampling_params.RequestOutputKind
        sp.output_kind = type(sp.output_kind)["FINAL_ONLY"]


def install_final_only_token_route() -> None:
    """Wrap vLLM's ``ServingTokens.serve_tokens`` (the ``/inference/v1/generate`` handler) with
    :func:`final_only_unless_streamed` (frontend process; idempotent)."""
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens

    original = ServingTokens.serve_tokens
    if getattr(original, "_asyncrl_final_only", False):
        return

    async def serve_tokens(self, request, raw_request=None):
        final_only_unless_streamed(request)
        return await original(self, request, raw_request)

    serve_tokens._asyncrl_final_only = True  # type: ignore[attr-defined]
    ServingTokens.serve_tokens = serve_tokens


def serve(cfg: Config, port: int) -> None:
    """Run vLLM's OpenAI server with our router until it is stopped."""
    import uvloop
    import vllm.entrypoints.openai.api_server as api
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    router = build_router(
        cfg.inference.admin_token,
        transport=cfg.weights.transport,
        roots=weights_roots(cfg),
        lora_base=Path(cfg.model.name) if cfg.model.lora.enabled else None,
    )
    original_build_app = api.build_app

    def build_app(args, supported_tasks=None, model_config=None):
        # vLLM's run_server looks build_app up in its module at call time, so the patch takes effect
        app = original_build_app(args, supported_tasks, model_config)
        app.include_router(router)
        return app

    api.build_app = build_app
    install_final_only_token_route()
    prepare_plugin(cfg)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_cli_args(cfg, port))
    if getattr(args, "model_tag", None):  # `vllm serve MODEL` copies the positional into args.model
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    log.info(f"vllm serve {' '.join(vllm_cli_args(cfg, port))}")
    uvloop.run(api.run_server(args))
