"""GPU fixtures: the small GPU model, SFT-warmed on the GPU. Every test here is marked `gpu`."""

from __future__ import annotations

import json
import os

import pytest

from helpers.launch import SMALL_TASK, asyncrl

GPU_COMMON = ["trainer.fabric.accelerator=cuda", "trainer.fabric.precision=bf16-mixed", "trainer.fabric.num_threads=0"]


def record(name: str, value) -> None:
    """Append a measured figure to $ASYNCRL_GPU_REPORT (JSON lines) so the GPU run's numbers come back."""
    path = os.environ.get("ASYNCRL_GPU_REPORT")
    line = json.dumps({"test": name, "value": value})
    print(f"RESULT {line}")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@pytest.fixture(scope="session")
def gpu_setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gpu")
    # sdpa here: the varlen path has its own test, so a problem there cannot take every GPU test down
    common = [
        f"data_dir={root / 'data'}",
        *SMALL_TASK,
        "seq_len=512",
        "model=gpu_small",
        "model.attn_implementation=sdpa",
        *GPU_COMMON,
    ]
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
    return {"root": root, "common": common, "base_model": root / "model", "sft_model": root / "sft" / "model"}
