"""The vLLM backend's arguments and routes, checked without vLLM or a GPU (the running server is tested
by tests/gpu on the lent GPU)."""

import asyncio
import enum
import json
import os
import shutil
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from asyncrl.config.compose import compose_config
from asyncrl.inference.vllm import plugin as vllm_plugin
from asyncrl.inference.vllm import sampled
from asyncrl.inference.vllm import sampling as vllm_sampling
from asyncrl.inference.vllm.backend import build_router
from asyncrl.inference.vllm.logprobs import ENV
from asyncrl.inference.vllm.server import (
    final_only_unless_streamed,
    install_final_only_token_route,
    prepare_plugin,
    tool_template_args,
    vllm_cli_args,
)
from asyncrl.inference.vllm.weights_check import directory_entries
from asyncrl.inference.vllm.worker import EXTENSION
from asyncrl.models import bitwise
from asyncrl.paths import STABLE
from asyncrl.transport.nccl import NCCL, write_manifest
from helpers.vllm_engine import FakeEngine


def test_cli_args():
    cfg = compose_config(
        [
            "inference.backend=vllm",
            "model=hf",
            "model.name=Qwen/Qwen3-0.6B",
            "seed=3",
            "inference.vllm.gpu_memory_utilization=0.4",
            "inference.vllm.enforce_eager=true",
            "inference.tensor_parallel=2",
            "inference.vllm.extra_args=[--kv-cache-dtype,fp8]",
        ]
    )
    args = vllm_cli_args(cfg, 8123)
    assert args[0] == "Qwen/Qwen3-0.6B" and args[args.index("--port") + 1] == "8123"
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"  # the trainer's ratio needs these
    assert args[args.index("--dtype") + 1] == "bfloat16" and args[args.index("--seed") + 1] == "3"
    # extra_args last: they win
    assert "--enforce-eager" in args and args[-2:] == ["--kv-cache-dtype", "fp8"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.4"
    assert "--disable-log-stats" in args  # vLLM's per-step statistics cost the frontend; on only when asked
    stats = vllm_cli_args(compose_config(["inference.backend=vllm", "inference.vllm.log_stats=true"]), 8123)
    assert "--disable-log-stats" not in stats


def test_a_template_without_tools_is_given_to_vllm_with_them(micro_model, tmp_path):
    """The micro model's template renders no tools: vLLM gets it with asyncrl's tool rendering (the built-in
    sidecar's and SFT's), read as text; not when the user names a template of their own."""
    from transformers import AutoTokenizer

    from asyncrl.models.tool_calls import render_chat

    cfg = compose_config([f"model.name={micro_model}"])
    args = tool_template_args(cfg, tmp_path)
    assert args == [
        "--chat-template",
        str(tmp_path / "chat_template.jinja"),
        "--chat-template-content-format",
        "string",
    ]
    tok = AutoTokenizer.from_pretrained(micro_model)
    messages, tools = (
        [{"role": "user", "content": "add 2 and 3"}],
        [{"type": "function", "function": {"name": "add"}}],
    )
    served = tok.apply_chat_template(
        messages,
        tools=tools,
        chat_template=Path(args[1]).read_text(),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert served == render_chat(tok, messages, tools, True) and "<tools>" in served
    own = compose_config(
        [f"model.name={micro_model}", "inference.vllm.extra_args=[--chat-template,t.jinja]"]
    )
    assert tool_template_args(own, tmp_path) == []
    own = compose_config(
        [f"model.name={micro_model}", 'inference.vllm.extra_args=["--chat-template=t.jinja"]']
    )
    assert tool_template_args(own, tmp_path) == []
    # naming only the content format keeps the tool template and the user's format
    fmt = compose_config(
        [f"model.name={micro_model}", "inference.vllm.extra_args=[--chat-template-content-format,openai]"]
    )
    assert tool_template_args(fmt, tmp_path) == ["--chat-template", str(tmp_path / "chat_template.jinja")]


def test_bitwise_mode_runs_vllm_as_the_trainer_reproduces_it():
    base = [
        "inference.backend=vllm",
        "model=hf",
        "model.name=Qwen/Qwen3-0.6B",
        "trainer.fabric.accelerator=cuda",
    ]
    default = vllm_cli_args(compose_config(base), 8000)
    assert "--attention-backend" not in default and "--enforce-eager" not in default
    args = vllm_cli_args(compose_config([*base, "numerics=bitwise"]), 8000)
    assert args[args.index("--attention-backend") + 1] == "TRITON_ATTN" and "--enforce-eager" not in args
    compilation = json.loads(args[args.index("--compilation-config") + 1])
    # graphs, no Inductor
    assert compilation["mode"] == 0 and compilation["cudagraph_mode"] == "FULL_DECODE_ONLY"
    # vLLM's own step sizes: the plugin makes every kernel invariant
    assert "--max-num-batched-tokens" not in args
    eager = vllm_cli_args(
        compose_config([*base, "numerics=bitwise", "inference.vllm.enforce_eager=true"]), 8000
    )
    assert "--enforce-eager" in eager and "--compilation-config" not in eager


def test_bitwise_plugin_swaps_vllms_residual_norm_only_in_bitwise_mode(monkeypatch):
    ops = types.ModuleType("vllm._custom_ops")
    cuda_kernel = object()
    ops.fused_add_rms_norm = cuda_kernel
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", ops)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("ASYNCRL_NUMERICS", "fast")
    vllm_plugin.register()
    assert ops.fused_add_rms_norm is cuda_kernel and not vllm_plugin.in_force()
    monkeypatch.setenv("ASYNCRL_NUMERICS", "bitwise")
    vllm_plugin.register()
    assert ops.fused_add_rms_norm is bitwise.fused_add_rms_norm and vllm_plugin.in_force()


def test_the_sidecar_knows_whether_vllm_will_load_the_plugin(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert vllm_plugin.plugin_problem() is None  # installed by `make install` (pip install -e .)
    monkeypatch.setenv("VLLM_PLUGINS", "someone_elses")
    assert "leaves out asyncrl's plugin" in vllm_plugin.plugin_problem()
    monkeypatch.setenv("VLLM_PLUGINS", "someone_elses,asyncrl_bitwise")
    assert vllm_plugin.plugin_problem() is None
    monkeypatch.setattr(vllm_plugin, "entry_points", lambda group: [])
    assert "pip install -e ." in vllm_plugin.plugin_problem()


GROUP = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}


def test_update_weights_route_sequence(micro_model):
    app = FastAPI()
    app.include_router(build_router(admin_token="t"))
    app.state.engine_client = engine = FakeEngine()
    with TestClient(app) as client:  # a non-loopback client: needs the token
        assert (
            client.post("/update_weights", json={"path": str(micro_model), "version": 2}).status_code == 403
        )
        auth = {"Authorization": "Bearer t"}
        assert (
            client.post("/update_weights", json={"path": "/nope", "version": 2}, headers=auth).status_code
            == 404
        )
        assert (
            client.post(
                "/update_weights", json={"path": str(micro_model), "version": -1}, headers=auth
            ).status_code
            == 422
        )
        r = client.post("/update_weights", json={"path": str(micro_model), "version": 2}, headers=auth)
        assert r.status_code == 200 and client.get("/policy").json() == {"version": 2}
    calls = ["pause", "asyncrl_check_weights", "reload_weights", "reset_prefix_cache", "resume"]
    assert [c[0] for c in engine.calls] == calls
    assert engine.calls[2][1] == {"weights_path": str(micro_model.resolve())}


def test_nccl_transport_routes(micro_model, tmp_path):
    """weights.transport=nccl: the server joins the trainer's group, then receives manifests' broadcasts."""

    cfg = compose_config(
        ["inference.backend=vllm", "weights.transport=nccl", "trainer.fabric.accelerator=cuda"]
    )
    args = vllm_cli_args(cfg, 8000)
    assert '{"backend": "nccl"}' in args
    assert args[args.index("--worker-extension-cls") + 1] == "asyncrl.inference.vllm.worker.WeightReceiver"
    files = vllm_cli_args(compose_config(["inference.backend=vllm"]), 8000)
    assert files[files.index("--worker-extension-cls") + 1] == EXTENSION  # its dry run checks every update
    manifest = tmp_path / "step_1"
    write_manifest(manifest, [("model.embed_tokens.weight", "bfloat16", [8, 4])], 1)
    group = GROUP

    plain = FastAPI()  # a server started for files refuses both
    plain.include_router(build_router(admin_token=None))
    plain.state.engine_client = FakeEngine()
    with TestClient(plain, client=("127.0.0.1", 5000)) as client:
        assert client.post("/init_weight_transfer", json=group).status_code == 409
        r = client.post("/update_weights", json={"path": str(manifest), "version": 1})
        assert r.status_code == 400 and "manifest" in r.json()["detail"]

    app = FastAPI()
    app.include_router(build_router(admin_token=None, transport=NCCL))
    app.state.engine_client = engine = FakeEngine()
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        r = client.post("/update_weights", json={"path": str(manifest), "version": 1})
        assert r.status_code == 409 and "init_weight_transfer" in r.json()["detail"]  # no group yet
        for bad in (
            {**group, "rank_offset": 2},
            {**group, "world_size": 1},
            {**group, "master_port": 0},
            {**group, "extra": 1},
            {"master_address": "x"},
        ):
            assert client.post("/init_weight_transfer", json=bad).status_code == 422, bad
        assert client.post("/init_weight_transfer", json=group).status_code == 200
        assert client.post("/init_weight_transfer", json=group).status_code == 409  # once per server
        assert client.post("/update_weights", json={"path": str(manifest), "version": 1}).status_code == 200
        # a retry: no second receive
        r = client.post("/update_weights", json={"path": str(manifest), "version": 1})
        assert r.status_code == 200 and r.json()["already_loaded"]
        assert (
            client.post("/update_weights", json={"path": str(micro_model), "version": 2}).status_code == 200
        )
        assert client.get("/policy").json() == {"version": 2}
    assert [c[0] for c in engine.calls] == [
        # checked before the group is asked for: a manifest that does not fit is a 400 with or without one
        "pause",
        "asyncrl_check_weights",
        "resume",
        "init_weight_transfer_engine",
        "pause",
        "asyncrl_check_weights",
        "asyncrl_load",
        "reset_prefix_cache",
        "resume",
        "pause",
        "asyncrl_check_weights",
        "reload_weights",
        "reset_prefix_cache",
        "resume",
    ]  # files still load from files
    assert engine.calls[3][1] == {"init_info": group}
    assert engine.calls[5][1] == {"entries": [("model.embed_tokens.weight", "bfloat16", [8, 4])]}
    # every worker runs the sender's own load (NCCL.worker_load), found again from its import path
    sent = engine.calls[6][1]
    assert sent["transport"] == NCCL.spec() and sent["manifest"]["names"] == ["model.embed_tokens.weight"]
    assert sent["manifest"]["reload"] == "direct"  # the manifest's (weights.reload)


def damaged_copy(model, out, cut: int = 0):
    """An unsealed copy of ``model``'s files, its weights file ``cut`` bytes short."""
    shutil.copytree(model, out)
    (out / STABLE).unlink(missing_ok=True)
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) - cut])
    return out


def test_an_update_that_does_not_fit_is_refused_before_any_weight_changes(
    micro_model, tmp_path, monkeypatch
):
    """The vLLM route's order: files that cannot be read, and shapes the starting model does not have, are
    refused before generation pauses; what the workers' meta-device dry run refuses, before anything
    loads."""
    from safetensors.torch import load_file, save_file

    shape = damaged_copy(micro_model, tmp_path / "shape")
    state = load_file(shape / "model.safetensors")
    name = next(n for n, t in state.items() if t.dim() == 2)
    save_file({**state, name: state[name][:, :3].contiguous()}, shape / "model.safetensors")
    for engine_problems, path, status, words in (
        ([], damaged_copy(micro_model, tmp_path / "cut", cut=100), 400, "truncated"),
        ([], shape, 400, f"{name} has shape"),
        (["3 parameters of the served model are not in the update"], micro_model, 400, "3 parameters"),
    ):
        app = FastAPI()
        app.include_router(build_router(admin_token=None, served=micro_model))
        app.state.engine_client = engine = FakeEngine(problems=engine_problems)
        with TestClient(app, client=("127.0.0.1", 5000)) as client:
            r = client.post("/update_weights", json={"path": str(path), "version": 1})
            assert r.status_code == status and words in r.json()["detail"], r.text
            assert client.get("/policy").json() == {"version": 0}
        checked = ["pause", "asyncrl_check_weights", "resume"] if engine_problems else []
        assert [c[0] for c in engine.calls] == checked  # nothing was loaded


@pytest.fixture
def stopped(monkeypatch) -> list[int]:
    """A 1 for each time the sidecar would have stopped itself (at once: no delay)."""
    calls: list[int] = []
    monkeypatch.setattr(
        "asyncrl.inference.vllm.backend.VLLMBackend.stop_serving", lambda self: calls.append(1)
    )
    monkeypatch.setattr("asyncrl.inference.vllm.backend.VLLMBackend.STOP_AFTER_S", 0.0)
    return calls


def nccl_sidecar(model, tmp_path, engine: FakeEngine, **kw) -> tuple[FastAPI, Path]:
    """The vLLM backend's routes for weights.transport=nccl over ``engine``, started from ``model``; and a
    manifest of ``model``'s tensors to send it (``kw``: :func:`build_router`'s)."""
    app = FastAPI()
    app.include_router(build_router(None, transport=NCCL, served=model, **kw))
    app.state.engine_client = engine
    manifest = tmp_path / "step_1"
    write_manifest(manifest, [(n, "bfloat16", shape) for n, _, shape in directory_entries(model)], 1)
    return app, manifest


def test_a_load_that_fails_after_the_checks_restores_or_stops_serving(micro_model, tmp_path, stopped):
    """Past the checks, a failed load reloads the served version's files (503, the version unchanged); when
    that fails too, the sidecar stays paused, answers 503 and stops itself."""
    app = FastAPI()
    app.include_router(build_router(admin_token=None, served=micro_model))
    app.state.engine_client = engine = FakeEngine(fail={"reload_weights": RuntimeError("disk gone")})
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        r = client.post("/update_weights", json={"path": str(micro_model), "version": 1})
        assert r.status_code == 503 and "policy 0 restored" in r.json()["detail"], r.text
        assert client.get("/policy").json() == {"version": 0}
        calls = ["pause", "asyncrl_check_weights", "reload_weights", "reload_weights", "resume"]
        assert [c[0] for c in engine.calls] == calls
    cut = {"asyncrl_load": RuntimeError("NCCL timeout"), "reload_weights": OSError("disk gone")}
    app, manifest = nccl_sidecar(micro_model, tmp_path, engine := FakeEngine(fail=cut))
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        assert client.post("/init_weight_transfer", json=GROUP).status_code == 200
        r = client.post("/update_weights", json={"path": str(manifest), "version": 1})
        assert r.status_code == 503 and "stops serving" in r.json()["detail"], r.text
        tried = ["pause", "asyncrl_check_weights", "asyncrl_load", "reload_weights"]
        assert [c[0] for c in engine.calls][-4:] == tried
        r = client.post("/update_weights", json={"path": str(micro_model), "version": 2})
        assert r.status_code == 503  # nothing loads into a sidecar that stopped serving
    assert "resume" not in [c[0] for c in engine.calls] and stopped == [1]


def test_a_broadcast_that_never_finishes_stops_serving_at_the_deadline(micro_model, tmp_path, stopped):
    """A trainer gone half-way through a broadcast leaves the workers waiting for the rest: past
    receive_timeout_s the sidecar answers 503, tries no restore (the workers are still inside the receive),
    stays paused and stops."""
    engine = FakeEngine(hang="asyncrl_load")
    app, manifest = nccl_sidecar(micro_model, tmp_path, engine, receive_timeout_s=0.2)
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        assert client.post("/init_weight_transfer", json=GROUP).status_code == 200
        r = client.post("/update_weights", json={"path": str(manifest), "version": 1})
        assert r.status_code == 503 and "did not finish in 0 s" in r.json()["detail"], r.text
        assert "stops serving" in r.json()["detail"] and client.get("/policy").json() == {"version": 0}
    assert [c[0] for c in engine.calls][-3:] == ["pause", "asyncrl_check_weights", "asyncrl_load"]
    assert stopped == [1]


class FakeModels:
    """vLLM's OpenAIServingModels as the LoRA path of /update_weights uses it."""

    def __init__(self, name: str):
        self.base_model_paths = [SimpleNamespace(name=name)]
        self.lora_requests: dict = {}
        self.calls: list = []

    async def load_lora_adapter(self, req):
        self.calls.append(("load", req.lora_path, req.load_inplace))
        if "broken" in req.lora_path:
            return SimpleNamespace(error=SimpleNamespace(message="invalid JSON in header"))
        self.lora_requests[req.lora_name] = req
        return "Success"

    async def unload_lora_adapter(self, req):
        self.calls.append(("unload", req.lora_name))
        del self.lora_requests[req.lora_name]
        return "Success"


def test_lora_update_routes(micro_model, tmp_path, monkeypatch):
    """model.lora on vLLM: adapters load under the served name (in place from the second on), the base model
    unloads them, other full weights are refused with a reason, a broken adapter is a 400, and a server
    without LoRA refuses an adapter."""

    protocol = ModuleType("vllm.entrypoints.serve.lora.protocol")  # no vLLM here: its two request types
    protocol.LoadLoRAAdapterRequest = lambda **kw: SimpleNamespace(**kw)
    protocol.UnloadLoRAAdapterRequest = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.serve.lora.protocol", protocol)
    for name in ("a1", "a2", "broken"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(
            '{"peft_type": "LORA", "r": 4, "lora_alpha": 8}'
        )
        (tmp_path / name / "adapter_model.safetensors").write_bytes(b"x")
    app = FastAPI()
    app.include_router(build_router(admin_token=None, lora_base=micro_model))
    # what vLLM's LoRA-wrapped layers answer a dry run of full weights (measured on an H200)
    lora_wrapped = "There is no module or parameter named 'layers.0.self_attn.qkv_proj.weight'"
    app.state.engine_client = engine = FakeEngine(problems=[lora_wrapped])
    app.state.openai_serving_models = models = FakeModels(str(micro_model))

    def update(path, version):
        return client.post("/update_weights", json={"path": str(path), "version": version})

    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        assert update(tmp_path / "a1", 1).status_code == 200
        assert update(tmp_path / "a2", 2).status_code == 200
        r = update(tmp_path / "broken", 3)
        assert r.status_code == 400 and "invalid JSON in header" in r.json()["detail"]
        other = tmp_path / "other"
        other.mkdir()
        (other / "model.safetensors").write_bytes(b"x")
        r = update(other, 3)
        assert r.status_code == 409 and "only the base model itself" in r.json()["detail"]
        assert update(micro_model, 4).status_code == 200 and client.get("/policy").json() == {"version": 4}
    a1, a2 = (str((tmp_path / n).resolve()) for n in ("a1", "a2"))
    assert models.calls[:3] == [
        ("load", a1, False),
        ("load", a2, True),
        ("load", str((tmp_path / "broken").resolve()), True),
    ]
    assert models.calls[3] == ("unload", str(micro_model)) and not models.lora_requests
    # the base weights were never checked or touched
    assert not {"asyncrl_check_weights", "reload_weights"} & {c[0] for c in engine.calls}

    plain = FastAPI()
    plain.include_router(build_router(admin_token=None))
    plain.state.engine_client = FakeEngine()
    with TestClient(plain, client=("127.0.0.1", 5000)) as client:
        r = client.post("/update_weights", json={"path": str(tmp_path / "a1"), "version": 1})
        assert r.status_code == 400 and "model.lora.enabled=true" in r.json()["detail"]


def test_the_sidecar_sets_the_plugins_switches_from_the_config(monkeypatch):
    base = ["inference.backend=vllm", "trainer.fabric.accelerator=cuda"]
    off = [*base, "inference.vllm.defer_logprobs=false", "inference.vllm.logprobs_kernel=false"]
    monkeypatch.setenv(ENV, "1")  # inherited from somewhere: the config decides
    monkeypatch.setenv(sampled.ENV, "1")
    prepare_plugin(compose_config(off))
    assert ENV not in os.environ and sampled.ENV not in os.environ
    prepare_plugin(compose_config(base))  # on by default
    assert os.environ[ENV] == "1" and os.environ[sampled.ENV] == "1"
    # one switch without the other
    prepare_plugin(compose_config([*base, "inference.vllm.defer_logprobs=false"]))
    assert ENV not in os.environ and os.environ[sampled.ENV] == "1"
    monkeypatch.setattr(vllm_plugin, "entry_points", lambda group: [])  # the plugin is not installed
    with pytest.raises(
        RuntimeError, match="inference.vllm.defer_logprobs=true and inference.vllm.logprobs_kernel="
    ):
        prepare_plugin(compose_config(base))
    with pytest.raises(RuntimeError, match="^inference.vllm.logprobs_kernel=true: asyncrl's vLLM plugin"):
        prepare_plugin(compose_config([*base, "inference.vllm.defer_logprobs=false"]))
    prepare_plugin(compose_config(off))  # nothing needs it


def test_bitwise_mode_pins_vllms_model_runner_to_the_trainers(monkeypatch, tmp_path):
    # the sampler the trainer mirrors is the model runner's (V1 for a mixture of experts): the sidecar pins
    # it
    from transformers import AutoConfig

    monkeypatch.setattr(vllm_plugin, "plugin_problem", lambda: None)
    monkeypatch.setenv(ENV, "0")  # prepare_plugin sets these: restored when the test ends
    monkeypatch.setenv(sampled.ENV, "0")
    base = ["inference.backend=vllm", "trainer.fabric.accelerator=cuda", "model=hf", "numerics=bitwise"]
    for kind, runner in (("qwen3_moe", "0"), ("qwen3", "1")):
        AutoConfig.for_model(kind).save_pretrained(tmp_path / kind)
        monkeypatch.setenv(bitwise.RUNNER_ENV, "unset")
        prepare_plugin(compose_config([*base, f"model.name={tmp_path / kind}"]))
        assert os.environ[bitwise.RUNNER_ENV] == runner
    # default mode leaves vLLM's choice, and the user's, alone
    monkeypatch.setenv(bitwise.RUNNER_ENV, "mine")
    prepare_plugin(compose_config([*base[:3], f"model.name={tmp_path / 'qwen3'}"]))
    assert os.environ[bitwise.RUNNER_ENV] == "mine"


# vllm.sampling_params.RequestOutputKind's members, as vLLM 0.26 has them
class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class GenerateRequest:  # the fields of vLLM's /inference/v1/generate request that the wrapper reads
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream: bool = False
    provided: set = field(default_factory=set)  # the sampling_params keys of the request's JSON body

    def __post_init__(self):
        self.sampling_params = SimpleNamespace(output_kind=self.output_kind)

    def is_sampling_param_provided(self, name: str) -> bool:
        return name in self.provided


@pytest.mark.parametrize(
    "request_, kind",
    [
        (GenerateRequest(), RequestOutputKind.FINAL_ONLY),  # vLLM's default, answered with its last output
        (GenerateRequest(stream=True), RequestOutputKind.CUMULATIVE),  # streamed: left to vLLM
        (GenerateRequest(provided={"output_kind"}), RequestOutputKind.CUMULATIVE),  # asked for: kept
        (GenerateRequest(RequestOutputKind.DELTA), RequestOutputKind.DELTA),
    ],
)
def test_the_token_route_answers_non_streamed_requests_final_only(request_, kind):
    """vLLM 0.26's token route at its default output kind answers n > 1 samples with only those still running
    at the last step (one choice of two in a GPU run); final-only, vLLM's aggregator waits for all of
    them."""
    final_only_unless_streamed(request_)
    assert request_.sampling_params.output_kind is kind


def test_the_token_route_wrapper_wraps_vllms_handler_once(monkeypatch):
    """install_final_only_token_route wraps vLLM's ServingTokens.serve_tokens (a stand-in module here: no
    vLLM on the CPU), hands the handler the request made final-only, and is idempotent."""

    seen = []

    class ServingTokens:
        async def serve_tokens(self, request, raw_request=None):
            seen.append((request.sampling_params.output_kind, raw_request))
            return "answer"

    name = "vllm.entrypoints.scale_out.token_in_token_out.serving"
    monkeypatch.setitem(sys.modules, name, SimpleNamespace(ServingTokens=ServingTokens))
    install_final_only_token_route()
    wrapped = ServingTokens.serve_tokens
    install_final_only_token_route()
    assert ServingTokens.serve_tokens is wrapped
    assert asyncio.run(ServingTokens().serve_tokens(GenerateRequest(), "raw")) == "answer"
    assert seen == [(RequestOutputKind.FINAL_ONLY, "raw")]


def test_the_plugin_makes_every_caller_of_vllms_top_k_top_p_sort(monkeypatch):
    """vLLM 0.26 switches to a Triton pivot search at 8 rows a batch; the plugin keeps the sort in every
    batch."""
    calls = []
    ops = types.ModuleType(vllm_sampling.CALLERS[0])
    ops.apply_top_k_top_p_pytorch = lambda logits, k, p: calls.append((logits, k, p)) or "sorted"
    triton = lambda logits, k, p: "pivot search"  # noqa: E731
    for name in vllm_sampling.CALLERS:
        module = ops if name == vllm_sampling.CALLERS[0] else types.ModuleType(name)
        module.apply_top_k_top_p = triton
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", types.ModuleType("vllm._custom_ops"))
    monkeypatch.setenv("ASYNCRL_NUMERICS", "fast")
    vllm_plugin.register()
    assert [sys.modules[n].apply_top_k_top_p("x" * 8, None, 0.9) for n in vllm_sampling.CALLERS] == [
        "sorted"
    ] * 4
    assert len(calls) == 4
    monkeypatch.setitem(sys.modules, vllm_sampling.CALLERS[0], types.ModuleType("renamed"))
    assert vllm_sampling.install() == []  # a vLLM without the sort keeps its own rule, with a warning
