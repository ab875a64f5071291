"""FSDP2 (two CPU processes, gloo) trains exactly like one process: same losses, same exported weights.

The GPU variant of this test (2 GPUs, NCCL, bf16) is tests/gpu/test_gpu.py::test_fsdp2_two_gpus_matches_one;
two torchrun "nodes" are tests/integration/test_multinode.py.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from helpers.launch import asyncrl
from helpers.synthetic import COMPARED, trainer_metrics, trainer_only_args, write_synthetic_rollouts

pytestmark = pytest.mark.slow


RUNS = {"single": [], "fsdp2": ["trainer.fabric.strategy=fsdp2", "trainer.fabric.devices=2"]}


def train_single_and_fsdp2(
    tmp_path, common: list[str], only: list[str] | None = None
) -> dict[str, list[dict]]:
    """The same 3 synthetic steps trained by one process and by FSDP2 over two: each run's trainer metrics
    (``only``: the runs to train here, the others already in ``tmp_path``)."""
    for name, extra in RUNS.items():
        if only is not None and name not in only:
            continue
        write_synthetic_rollouts(tmp_path / name, steps=3, ranks=2)
        proc = asyncrl("train", *common, f"run_dir={tmp_path / name}", *extra, timeout=300)
        assert proc.returncode == 0, proc.stderr
    return {n: trainer_metrics(tmp_path / n) for n in RUNS}


def test_fsdp2_on_two_processes_matches_one(micro_model, single_process_trainer, tmp_path):
    # the session's one-process run of the same steps
    (tmp_path / "single").symlink_to(single_process_trainer)
    runs = RUNS
    metrics = train_single_and_fsdp2(tmp_path, trainer_only_args(micro_model), only=["fsdp2"])
    # started without `asyncrl rl` (as docker compose does), the trainer writes the run's own record
    meta = json.loads((tmp_path / "fsdp2" / "run_meta.json").read_text())
    assert meta["started_by"] == "asyncrl train" and "git_sha" in meta
    assert (tmp_path / "fsdp2" / "configs" / "config.yaml").is_file()
    for key in COMPARED:
        a = [r[key] for r in metrics["single"]]
        b = [r[key] for r in metrics["fsdp2"]]
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7), key
    single, sharded = (
        load_file(str(tmp_path / n / "weights" / "step_3" / "model.safetensors")) for n in runs
    )
    start = load_file(str(micro_model / "model.safetensors"))
    assert single.keys() == sharded.keys()
    # Element-wise comparisons after Adam are fragile (a near-zero gradient summed in another order can
    # flip an update's sign); what must hold is that the two updates are the same update.
    diff = sum(float((single[k] - sharded[k]).norm() ** 2) for k in single) ** 0.5
    update = sum(float((single[k] - start[k]).norm() ** 2) for k in single) ** 0.5
    assert update > 0 and diff / update < 1e-2, (diff, update)  # measured: 1.3e-3
    assert (tmp_path / "fsdp2" / "checkpoints" / "step_3" / "trainer" / "STABLE").exists()


def test_fsdp2_lora_on_two_processes_matches_one(micro_model, tmp_path):
    """model.lora under FSDP2 (frozen base and trainable adapters sharded together): the same losses and the
    same adapter hand-off as one process."""
    common = [
        *trainer_only_args(micro_model),
        "model.lora.enabled=true",
        "model.lora.r=4",
        "trainer.optim.lr=1e-2",
    ]
    runs = RUNS
    metrics = train_single_and_fsdp2(tmp_path, common)
    for key in COMPARED:
        assert [r[key] for r in metrics["single"]] == pytest.approx(
            [r[key] for r in metrics["fsdp2"]], rel=1e-5, abs=1e-7
        )
    single, sharded = (
        load_file(str(tmp_path / n / "weights" / "step_3" / "adapter_model.safetensors")) for n in runs
    )
    assert single.keys() == sharded.keys() and all(".lora_" in k for k in single)
    b = [k for k in single if ".lora_B." in k]
    diff = sum(float((single[k] - sharded[k]).norm() ** 2) for k in b) ** 0.5
    size = sum(float(single[k].norm() ** 2) for k in b) ** 0.5  # B starts at 0: its norm is the update
    assert size > 0 and diff / size < 1e-2, (diff, size)
    assert (tmp_path / "fsdp2" / "model" / "model.safetensors").exists()  # merged at the end
