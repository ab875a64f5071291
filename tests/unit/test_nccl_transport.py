"""The nccl weight transport's pure parts: which versions are broadcast, the manifest, what the trainer
sends, and the config checks (the broadcast itself runs in tests/gpu on two GPUs)."""

import pytest

from asyncrl.config import ConfigError, inference_workers
from asyncrl.config.compose import compose_config
from asyncrl.transport.nccl import MANIFEST, NCCL, iter_export, update_info, write_manifest
from asyncrl.transport.streamed import export_entries, sent_directly

read_manifest = NCCL.read_manifest

GPU = ["weights.transport=nccl", "inference.backend=vllm", "trainer.fabric.accelerator=cuda"]


@pytest.mark.parametrize(
    "k,interval,expected",
    [
        # max_steps 10: strict mode loads versions 1 .. 9 - k; checkpoints pin versions c - k .. c on disk
        (1, 0, [1, 2, 3, 4, 5, 6, 7, 8]),
        (0, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9]),
        (2, 0, [1, 2, 3, 4, 5, 6, 7]),
        (1, 4, [1, 2, 5, 6]),  # checkpoints at 4, 8, 10 keep 3-4, 7-8 (and 9-10) as files
    ],
)
def test_sent_directly(k, interval, expected):
    cfg = compose_config(GPU + ["max_steps=10", f"async_level={k}", f"ckpt.interval={interval}"])
    assert [v for v in range(12) if sent_directly(v, cfg)] == expected
    files = compose_config(["max_steps=10"])  # the filesystem transport never broadcasts
    assert not any(sent_directly(v, files) for v in range(12))


def test_inference_workers():
    assert inference_workers(compose_config(GPU)) == 1
    assert inference_workers(compose_config(GPU + ["inference.gpus=['2','3']"])) == 2
    assert (
        inference_workers(compose_config(GPU + ["inference.gpus=['2,3']", "inference.tensor_parallel=2"]))
        == 2
    )
    two_tp4 = compose_config(GPU + ["inference.urls=[http://a:1,http://b:2]", "inference.tensor_parallel=4"])
    assert inference_workers(two_tp4) == 8


def test_manifest_round_trip(tmp_path, micro_model):
    import torch

    from asyncrl.models.hf import load_model
    from asyncrl.paths import stable

    model = load_model(compose_config([f"model.name={micro_model}"]).model, dtype="float32")
    entries = export_entries(model, torch.bfloat16)
    sent = list(iter_export(model, torch.bfloat16))
    # the receiver allocates from the manifest: names, dtypes and shapes must match the tensors in order
    assert [(n, "bfloat16", list(t.shape)) for n, t in sent] == entries
    assert all(t.dtype == torch.bfloat16 for _, t in sent)
    assert "lm_head.weight" not in dict(sent)  # tied to the embeddings: vLLM ties it itself
    write_manifest(tmp_path / "step_3", entries, 3)
    assert stable(tmp_path / "step_3") and (tmp_path / "step_3" / MANIFEST).is_file()
    manifest = read_manifest(tmp_path / "step_3")
    info = update_info(manifest)
    assert manifest["version"] == 3 and info["packed"] is True and manifest["reload"] == "direct"
    assert "reload" not in info  # the worker extension's argument, not vLLM's update info
    assert list(zip(info["names"], info["dtype_names"], info["shapes"], strict=True)) == [
        tuple(e) for e in entries
    ]
    assert read_manifest(micro_model) is None  # a safetensors directory: loaded from files
    write_manifest(tmp_path / "step_4", entries, 4, reload="layerwise")
    assert read_manifest(tmp_path / "step_4")["reload"] == "layerwise"


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["weights.transport=nccl", "trainer.fabric.accelerator=cuda"], "inference.backend=vllm"),
        (["weights.transport=nccl", "inference.backend=vllm"], "trainer.fabric.accelerator=cuda"),
        (GPU + ["strict_async=false"], "strict_async=true"),
        (GPU + ["inference.gpus=['0']", "trainer.fabric.gpus='1,0'", "trainer.fabric.devices=2"], "GPU 0"),
        (["weights.transport=shm"], "weights.transport"),
    ],
)
def test_nccl_config_errors(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_config(overrides)
    compose_config(GPU + ["inference.gpus=['0']", "trainer.fabric.gpus='1'"])  # separate GPUs: fine


def test_a_streamed_transport_publishes_as_files_what_it_may_not_send(tmp_path):
    """The trainer's one publisher per run: versions sent_directly go to the streamed publisher, the rest
    (what a checkpoint needs on disk, what no sidecar will load) to the files publisher, each exactly
    once."""
    from asyncrl.transport.streamed import StreamedOrFiles

    class Record:
        def __init__(self):
            self.versions: list[int] = []

        def publish(self, version, path):
            self.versions.append(version)

    cfg = compose_config(GPU + ["max_steps=10", "async_level=1", "ckpt.interval=4"])
    streamed, files = Record(), Record()
    publisher = StreamedOrFiles(cfg, streamed, files)
    for v in range(1, 11):
        publisher.publish(v, tmp_path / f"step_{v}")
    assert streamed.versions == [1, 2, 5, 6] and files.versions == [3, 4, 7, 8, 9, 10]
