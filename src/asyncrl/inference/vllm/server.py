"""The vLLM backend (``inference.backend=vllm``): vLLM's own OpenAI server, with asyncrl's routes added.

Serving is entirely vLLM's (``/v1/chat/completions`` with ``return_token_ids`` and logprobs, continuous
batching, prefix caching, CUDA graphs). asyncrl adds, on the same app, the sidecar's shared admin routes
(``/update_weights``, ``/pause``, ``/resume``, ``/policy``; :mod:`asyncrl.inference.admin_routes`) answered
by :class:`asyncrl.inference.vllm.backend.VLLMBackend`, and ``/init_weight_transfer`` for a transport with a
rendezvous.

Two changes to routes of vLLM's: a chat request may ask for its sampled logprobs as one array a choice
(``logprobs_encoding``, as asyncrl's client does;
:func:`asyncrl.inference.vllm.frontend.install_compact_answers`); a non-streaming ``/inference/v1/generate``
request (verifiers' token route) returns only its final output (:func:`final_only_unless_streamed`).

Logprobs are ``processed_logprobs`` (after temperature and top-p), as the trainer's importance ratio needs.
Admin routes answer loopback clients only unless ``inference.admin_token`` is set. vLLM's own dev-mode
routes of the same names stay off (``VLLM_SERVER_DEV_MODE`` unset), so ours are the ones served.
Written against vLLM 0.26.0 (``vllm.entrypoints.openai.api_server``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.middleware import Middleware

from asyncrl.config import Config
from asyncrl.inference.admin import weights_roots
from asyncrl.inference.errors import BadRequest
from asyncrl.inference.recording import RolloutEndpoints, Rollouts
from asyncrl.inference.vllm import sampled
from asyncrl.inference.vllm.backend import build_router
from asyncrl.inference.vllm.frontend import install_compact_answers
from asyncrl.inference.vllm.logprobs import ENV
from asyncrl.inference.vllm.plugin import plugin_problem
from asyncrl.inference.vllm.worker import EXTENSION
from asyncrl.models.adapters import vllm_max_rank
from asyncrl.models.bitwise import runner_env
from asyncrl.models.hf import load_tokenizer
from asyncrl.models.tool_calls import tool_template
from asyncrl.transport.base import transport_of

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
    if not v.log_stats:
        args.append("--disable-log-stats")
    if bitwise:
        # what asyncrl.models.bitwise reproduces (VLLM_BATCH_INVARIANT=1 comes from asyncrl.numerics, the
        # residual RMSNorm from asyncrl's vLLM plugin): the Triton attention kernel and vLLM's eager ops,
        # which CUDA graphs replay as they are; Inductor (compilation mode 3) fuses them into other roundings
        # (`python benchmarks/bitwise_probe.py --help` compares eager, graphs and compiled against the
        # trainer's rows)
        if not v.enforce_eager:
            args += ["--compilation-config", BITWISE_COMPILATION]
        args += ["--attention-backend", "TRITON_ATTN"]
    if v.max_model_len:
        args += ["--max-model-len", str(v.max_model_len)]
    if cfg.inference.tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(cfg.inference.tensor_parallel)]
    if not v.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    args += transport_of(cfg).vllm_args(cfg)
    # every transport: the extension also checks an update on the meta device before it is loaded
    args += ["--worker-extension-cls", EXTENSION]
    if cfg.orchestrator.routed_experts:
        # every chat choice then carries its tokens' experts (base64 .npy, read by asyncrl.rollouts.answers)
        args.append("--enable-return-routed-experts")
    if cfg.model.lora.enabled:  # one adapter slot: each policy replaces the last in place
        args += [
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-lora-rank",
            str(vllm_max_rank(cfg.model.lora.r)),
        ]
        # only the layers the trainer adapts get vLLM's LoRA wrappers: none on lm_head (a wasted vocab-sized
        # matmul per token, and vLLM 0.26's warm-up adapter for it fails on a vocabulary under 256)
        args += ["--lora-target-modules", *cfg.model.lora.target_modules]
    return args + list(v.extra_args)


def tool_template_args(cfg: Config, where: Path) -> list[str]:
    """``--chat-template`` for a model whose template renders no tools: the same template with tools and
    calls rendered as the built-in sidecar and SFT render them
    (:func:`asyncrl.models.tool_calls.tool_template`, written under ``where``), so an agent's tools reach the
    model, and its calls come back as the text it sampled, on both backends. Nothing when the template has
    its own tools, or ``inference.vllm.extra_args`` names one."""
    named = {a.split("=", 1)[0] for a in cfg.inference.vllm.extra_args}
    if "--chat-template" in named:
        return []
    template = tool_template(load_tokenizer(cfg.model))
    if template is None:
        return []
    path = where / "chat_template.jinja"
    path.write_text(template)
    args = ["--chat-template", str(path)]
    # "string": the preamble reads each message's content as text, whatever vLLM's detection would guess
    return (
        args
        if "--chat-template-content-format" in named
        else [*args, "--chat-template-content-format", "string"]
    )


def prepare_plugin(cfg: Config) -> None:
    """Before vLLM starts: refuse when the config needs asyncrl's vLLM plugin and vLLM would not load it, and
    set the plugin's switches in the environment, which vLLM's engine-core process inherits."""
    # without the plugin the sidecar's logprobs would silently differ from the trainer's (bitwise), or its
    # speed-up would silently not happen (defer_logprobs)
    needs_plugin = []
    if cfg.numerics == "bitwise":
        needs_plugin.append("numerics=bitwise")
    switches = {ENV: cfg.inference.vllm.defer_logprobs, sampled.ENV: cfg.inference.vllm.logprobs_kernel}
    needs_plugin += [f"inference.vllm.{key}=true" for key in ("defer_logprobs", "logprobs_kernel")
                     if getattr(cfg.inference.vllm, key)]  # fmt: skip
    if needs_plugin and (problem := plugin_problem()):
        raise RuntimeError(f"{' and '.join(needs_plugin)}: {problem}")
    # the config decides, not an inherited environment: vLLM's engine-core process inherits this one's
    for name, on in switches.items():
        os.environ.pop(name, None)
        if on:
            os.environ[name] = "1"
    # the model runner whose sampler the trainer mirrors, whatever vLLM would pick
    if cfg.numerics == "bitwise":
        from transformers import AutoConfig  # lazy: reads the model's config.json

        os.environ.update(
            runner_env(
                AutoConfig.from_pretrained(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
            )
        )


def final_only_unless_streamed(request: Any) -> None:
    """Make a non-streaming ``/inference/v1/generate`` request (vLLM's ``GenerateRequest``) final-only, as
    vLLM's OpenAI routes make theirs, unless its ``sampling_params`` asked for another output kind than the
    default.

    vLLM 0.26 leaves the token route at ``SamplingParams``' default, ``CUMULATIVE``, and answers with the
    last output the engine streamed. With ``n > 1``, once one sample has finished the later outputs hold only
    the others, so a sample that finished early would be missing from the answer (``n=2`` can answer one
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
    # vLLM is GPU-only: the CPU install has none
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens

    original = ServingTokens.serve_tokens
    if getattr(original, "_asyncrl_final_only", False):
        return

    async def serve_tokens(self, request, raw_request=None):
        final_only_unless_streamed(request)
        return await original(self, request, raw_request)

    serve_tokens._asyncrl_final_only = True  # type: ignore[attr-defined]
    ServingTokens.serve_tokens = serve_tokens


async def model_card(model_id: str, request: Request) -> Any:
    """``GET /v1/models/{id}``: the entry of ``/v1/models`` for that id, or OpenAI's 404 (vLLM 0.26 serves
    the list only)."""
    listing = await request.app.state.openai_serving_models.show_available_models()
    for card in listing.data:
        if card.id == model_id:
            return card
    raise BadRequest(f"The model `{model_id}` does not exist.", 404, "model")


async def no_route(path: str, request: Request) -> None:
    raise BadRequest(f"no route {request.method} /{path} on this server", 404)


def serve(cfg: Config, port: int) -> None:
    """Run vLLM's OpenAI server with asyncrl's routes until it is stopped."""
    # a tool marked strict (pydantic-ai marks every one) would have vLLM constrain decoding to its schema, in
    # its own Hermes layout: the policy's samples must be its own distribution, whose logprobs the trainer
    # recomputes (and vLLM 0.26's engine fails such a request: tests/gpu/test_agent_vllm.py)
    os.environ["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"
    # vLLM (and the uvloop it brings) is GPU-only: the CPU install has none
    import uvloop
    import vllm.entrypoints.openai.api_server as api
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    rollouts = Rollouts()
    router = build_router(
        cfg.inference.admin_token,
        transport=transport_of(cfg),
        roots=weights_roots(cfg),
        lora_base=Path(cfg.model.name) if cfg.model.lora.enabled else None,
        served=cfg.model.name,
        receive_timeout_s=cfg.orchestrator.request_timeout_s,
        rollouts=rollouts,
    )
    original_build_app = api.build_app

    def build_app(args, supported_tasks=None, model_config=None):
        # vLLM's run_server looks build_app up in its module at call time, so the patch takes effect
        app = original_build_app(args, supported_tasks, model_config)
        app.include_router(router)
        max_bytes = int(cfg.inference.max_body_mb * 2**20)
        # outermost, as add_middleware would put it; vLLM's build_app has built the stack already, so it is
        # dropped here and Starlette builds it again, with this one, on the first request
        endpoints = Middleware(
            RolloutEndpoints, rollouts=rollouts, served=cfg.model.name, max_bytes=max_bytes
        )
        app.user_middleware.insert(0, endpoints)
        app.middleware_stack = None
        app.add_api_route("/v1/models/{model_id:path}", model_card, methods=["GET"])
        # last, so that every real route matches first: an unknown route answers OpenAI's error shape, as the
        # built-in sidecar does (vLLM 0.26's app answers FastAPI's {"detail": ...}; an exception handler for
        # it, added here, is not consulted, as measured on the GPU by tests/gpu/test_vllm_update_refusals.py)
        app.add_api_route("/{path:path}", no_route, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        return app

    api.build_app = build_app
    install_final_only_token_route()
    install_compact_answers()
    prepare_plugin(cfg)
    # the template lives as long as the server
    with tempfile.TemporaryDirectory(prefix="asyncrl-vllm-") as where:
        argv = vllm_cli_args(cfg, port) + tool_template_args(cfg, Path(where))
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        if getattr(args, "model_tag", None):  # `vllm serve MODEL` copies the positional into args.model
            args.model = args.model_tag
        validate_parsed_serve_args(args)
        log.info(f"vllm serve {' '.join(argv)}")
        uvloop.run(api.run_server(args))
