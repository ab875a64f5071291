"""weights.transport=ipc's CPU-side parts: the config checks, the handle's JSON form, the manifest, the
loaded marker the trainer waits for, the sidecar's views of the buffer and its route (the CUDA IPC itself
runs in tests/gpu and benchmarks/weight_transfer.py --transport ipc)."""

import threading
import time

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.transport import ipc
from asyncrl.transport.streamed import sent_directly

OK = [
    "weights.transport=ipc",
    "inference.backend=vllm",
    "trainer.fabric.accelerator=cuda",
    "inference.gpus=['0']",
    "trainer.fabric.gpus='0'",
    "inference.share_gpus=true",
]


def test_config():
    compose_config(OK)  # one trainer process on the sidecar's GPU
    compose_config([*OK[:3]])  # both on the default device
    assert [v for v in range(12) if sent_directly(v, compose_config([*OK, "max_steps=10"]))] == list(
        range(1, 9)
    )


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["weights.transport=ipc", "trainer.fabric.accelerator=cuda"], "inference.backend=vllm"),
        ([*OK, "strict_async=false"], "strict_async=true"),
        ([*OK[:3], "inference.gpus=['0']", "trainer.fabric.gpus='1'"], "the trainer on the sidecar's GPU"),
        ([*OK[:3], "inference.gpus=['0','1']"], "one sidecar"),
        ([*OK[:3], "inference.gpus=['0,1']", "inference.tensor_parallel=2"], "one sidecar"),
        ([*OK[:5]], "inference.share_gpus=true"),  # the shared GPU must be said to be shared
        ([*OK[:3], "trainer.fabric.gpus='0,1'", "trainer.fabric.devices=2"], "one-process trainer"),
        ([*OK, "model.lora.enabled=true"], "model.lora.enabled=true needs weights.transport=filesystem"),
    ],
)
def test_config_errors(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("[", r"\[")):
        compose_config(overrides)


def fake_args():
    """What ``reduce_tensor`` gives for a CUDA tensor, with stand-in handles."""
    import torch

    return (
        torch.Tensor,
        torch.Size([96]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        0,
        b"\x00cuda-handle\xff",
        96,
        0,
        False,
        b"/torch_123_ref",
        16,
        b"event\x01",
        True,
    )


def test_handle_round_trip():
    import json

    args = fake_args()
    encoded = json.loads(json.dumps(ipc.encode_handle(args)))  # what a manifest file holds
    assert ipc.decode_handle(encoded) == args
    assert ipc.decode_handle({**encoded, "event_handle": None})[13] is None
    with pytest.raises(ValueError, match="tensor_cls"):
        ipc.decode_handle({**encoded, "tensor_cls": "os.system"})  # only known classes, never an import
    with pytest.raises(ValueError, match="fields"):
        ipc.decode_handle({**encoded, "extra": 1})


def test_manifest_and_loaded_marker(tmp_path, micro_model):
    import torch

    from asyncrl.models.hf import load_model
    from asyncrl.paths import stable
    from asyncrl.transport.streamed import export_entries

    model = load_model(compose_config([f"model.name={micro_model}"]).model, dtype="float32")
    entries = export_entries(model, torch.bfloat16)
    sizes = [2 * torch.Size(shape).numel() for _, _, shape in entries]
    step = tmp_path / "step_2"
    ipc.write_manifest(step, entries, sizes, 2, "GPU-x", ipc.encode_handle(fake_args()))
    assert stable(step) and ipc.IPC.read_manifest(tmp_path) is None
    manifest = ipc.IPC.read_manifest(step)
    assert manifest["names"] == [n for n, _, _ in entries] and manifest["tensor_sizes"] == sizes
    assert manifest["reload"] == "direct" and manifest["gpu_uuid"] == "GPU-x"

    with pytest.raises(TimeoutError, match="relay every version"):
        ipc.wait_loaded(step, timeout_s=0.05)
    threading.Timer(0.1, ipc.mark_loaded, (step, 0.01)).start()
    t0 = time.monotonic()
    waited = ipc.wait_loaded(step, timeout_s=10)
    assert 0.05 < waited < 5 and time.monotonic() - t0 < 5
    assert (step / ipc.LOADED).is_file()


def test_manifest_problems():
    good = {"version": 3, "names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]], "tensor_sizes": [4],
            "gpu_uuid": "GPU-x", "handle": ipc.encode_handle(fake_args()), "reload": "direct"}  # fmt: skip
    assert ipc.manifest_problem(good, 3) is None
    for bad, why in (
        ({k: v for k, v in good.items() if k != "handle"}, "lacks ['handle']"),
        (good, "holds version 3, not 4"),
        ({**good, "shapes": []}, "differ in length"),
        ({**good, "reload": "fast"}, "reload='fast'"),
        ({**good, "handle": {**good["handle"], "storage_cls": "Pickler"}}, "handle: storage_cls"),
        ({**good, "handle": {**good["handle"], "handle": 7}}, "handle:"),
    ):
        assert why in (ipc.manifest_problem(bad, 4 if "version 3" in why else 3) or ""), why


def test_the_run_config_asyncrl_rl_writes_passes_the_check(tmp_path):
    """`asyncrl rl` fills inference.urls with its sidecar before every process loads the written config."""
    from asyncrl.config.compose import load_config_file, to_yaml
    from asyncrl.launcher.rl import plan_sidecars

    cfg = compose_config(OK)
    assert len(plan_sidecars(cfg)) == 1 and len(cfg.inference.urls) == 1
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert load_config_file(tmp_path / "config.yaml").weights.transport == "ipc"


def test_shared_views_lay_out_the_manifest():
    import torch

    from asyncrl.transport.ipc import shared_views

    tensors = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.arange(5, dtype=torch.float32)}
    raw = [t.contiguous().view(torch.uint8).view(-1) for t in tensors.values()]
    buffer = torch.cat([*raw, torch.zeros(7, dtype=torch.uint8)])  # the trainer's buffer may be larger
    manifest = {
        "names": list(tensors),
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[3, 4], [5]],
        "tensor_sizes": [r.numel() for r in raw],
    }
    views = dict(shared_views(buffer, manifest))
    assert all(torch.equal(views[n], t) for n, t in tensors.items())
    assert views["a"].data_ptr() == buffer.data_ptr()  # views, not copies
    with pytest.raises(ValueError, match="shared buffer holds"):
        shared_views(buffer[:10], manifest)


def test_the_route_copies_then_marks_loaded(tmp_path, micro_model):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from asyncrl.inference.vllm.backend import build_router
    from helpers.vllm_engine import FakeEngine

    step = tmp_path / "step_1"
    ipc.write_manifest(
        step, [("w", "bfloat16", [2])], [4], 1, "GPU-x", ipc.encode_handle(fake_args()), "layerwise"
    )
    app = FastAPI()
    app.include_router(build_router(admin_token=None, transport=ipc.IPC))
    app.state.engine_client = engine = FakeEngine()
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        r = client.post("/update_weights", json={"path": str(step), "version": 2})
        assert r.status_code == 400 and "holds version 1, not 2" in r.json()["detail"]
        assert client.post("/update_weights", json={"path": str(step), "version": 1}).status_code == 200
        assert (step / ipc.LOADED).is_file()
        # a retry of the same request must not read the buffer again: the trainer may be filling it by now
        r = client.post("/update_weights", json={"path": str(step), "version": 1})
        assert r.status_code == 200 and r.json()["already_loaded"]
        assert (
            client.post("/update_weights", json={"path": str(micro_model), "version": 2}).status_code == 200
        )
    fresh = FastAPI()  # a sidecar that restarted (version 0) cannot read a buffer that moved on
    fresh.include_router(build_router(admin_token=None, transport=ipc.IPC))
    fresh.state.engine_client = FakeEngine()
    with TestClient(fresh, client=("127.0.0.1", 5000)) as client:
        r = client.post("/update_weights", json={"path": str(step), "version": 1})
        assert r.status_code == 409 and "restarted" in r.json()["detail"]
        assert (
            client.post(
                "/init_weight_transfer",
                json={"master_address": "a", "master_port": 1, "rank_offset": 1, "world_size": 2},
            ).status_code
            == 409
        )
    assert [c[0] for c in engine.calls] == [
        "pause", "asyncrl_check_weights", "asyncrl_load", "reset_prefix_cache", "resume",
        "pause", "asyncrl_check_weights", "reload_weights", "reset_prefix_cache", "resume",
    ]  # fmt: skip
    assert engine.calls[1][1] == {"entries": [("w", "bfloat16", [2])]}  # checked before the buffer is read
    sent = engine.calls[2][1]
    assert sent["transport"] == ipc.IPC.spec() and sent["manifest"]["reload"] == "layerwise"
    assert sent["manifest"]["names"] == ["w"]

    plain = FastAPI()  # a server not started for ipc refuses its manifests
    plain.include_router(build_router(admin_token=None))
    plain.state.engine_client = FakeEngine()
    with TestClient(plain, client=("127.0.0.1", 5000)) as client:
        r = client.post("/update_weights", json={"path": str(step), "version": 1})
        assert r.status_code == 400 and "weights.transport=ipc" in r.json()["detail"]
