"""GPU fixtures: the small GPU model, SFT-warmed on the GPU. Every test here is marked `gpu`."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

from helpers.launch import SMALL_TASK, asyncrl

GPU_COMMON = [
    "trainer.fabric.accelerator=cuda",
    "trainer.fabric.precision=bf16-mixed",
    "trainer.fabric.num_threads=0",
]


def record(name: str, value) -> None:
    """Append a measured figure to $ASYNCRL_GPU_REPORT (JSON lines) so the GPU run's numbers come back."""
    path = os.environ.get("ASYNCRL_GPU_REPORT")
    line = json.dumps({"test": name, "value": value})
    print(f"RESULT {line}")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# a Qwen3-MoE of gpu_small's shape (head_dim 64 for vLLM's FlashAttention-3): 8 experts of width 256 per
# layer, each token routed to 2 (Qwen3-MoE's renormalised top-k); every layer a MoE layer, as vLLM's routes
# need
GPU_MOE = [
    "model.init.architecture=Qwen3MoeForCausalLM",
    "model.init.num_experts=8",
    "model.init.num_experts_per_tok=2",
    "model.init.moe_intermediate_size=256",
    "model.init.norm_topk_prob=true",
]


def shared_common(root, *model: str) -> list[str]:
    """The overrides every run on the prepared model shares: its data, task, shape and the GPU trainer."""
    # sdpa here: the varlen path has its own test, so a problem there cannot take every GPU test down
    return [
        f"data_dir={root / 'data'}",
        *SMALL_TASK,
        "seq_len=512",
        "model=gpu_small",
        *model,
        "model.attn_implementation=sdpa",
        *GPU_COMMON,
    ]


def prepare_and_sft(root, *model: str) -> dict:
    """``model=gpu_small`` (with ``model`` overrides) built, then SFT-warmed on the reverse-text task on the
    GPU."""
    common = shared_common(root, *model)
    asyncrl("prepare", *common, f"model.name={root / 'model'}", check=True)
    asyncrl(
        "sft",
        *common,
        f"model.name={root / 'model'}",
        f"sft.run_dir={root / 'sft'}",
        "sft.max_steps=150",
        "sft.optim.lr=2e-3",
        check=True,
        timeout=600,
    )
    return {
        "root": root,
        "common": common,
        "base_model": root / "model",
        "sft_model": root / "sft" / "model",
    }


def shared_setup(tmp_path_factory, name: str, *model: str) -> dict:
    """:func:`prepare_and_sft` once per machine where $ASYNCRL_GPU_SETUP_DIR names a folder: the pytest
    processes that run side by side on one GPU each (benchmarks/gpu_suite_lanes.sh) build it under a file
    lock, one of them, and the others and later calls reuse it; elsewhere once per session, in its temporary
    folder."""
    shared = os.environ.get("ASYNCRL_GPU_SETUP_DIR")
    if not shared:
        return prepare_and_sft(tmp_path_factory.mktemp(name), *model)
    root = Path(shared) / name
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while one process builds; the others wait for it
        if not (root / "READY").is_file():
            if root.exists():  # a build that died half way
                shutil.rmtree(root)
            prepare_and_sft(root, *model)
            (root / "READY").touch()
    return {
        "root": root,
        "common": shared_common(root, *model),
        "base_model": root / "model",
        "sft_model": root / "sft" / "model",
    }


@pytest.fixture(scope="session")
def gpu_setup(tmp_path_factory) -> dict:
    return shared_setup(tmp_path_factory, "gpu")


@pytest.fixture(scope="session")
def gpu_moe_setup(tmp_path_factory) -> dict:
    """The GPU mixture of experts (:data:`GPU_MOE`), SFT-warmed as the dense one."""
    return shared_setup(tmp_path_factory, "gpu_moe", *GPU_MOE)
