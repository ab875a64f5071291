"""SFT warmup: resuming from a checkpoint continues exactly where a straight run would be."""

import pytest
from safetensors.numpy import load_file

from conftest import asyncrl, learning_metrics

pytestmark = pytest.mark.slow


def _metrics(run):
    return learning_metrics(run / "metrics" / "sft.jsonl")


def test_sft_resume_matches_straight_run(setup, tmp_path):
    base = [*setup["common"], f"model.name={setup['base_model']}", "ckpt.interval=3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    asyncrl("sft", *base, f"sft.run_dir={straight}", "sft.max_steps=6", check=True)
    asyncrl("sft", *base, f"sft.run_dir={resumed}", "sft.max_steps=3", check=True)
    bad = asyncrl("sft", *base, f"sft.run_dir={resumed}", "sft.max_steps=6", "ckpt.resume=5")
    assert bad.returncode == 2 and "no SFT checkpoint 5" in bad.stderr
    asyncrl("sft", *base, f"sft.run_dir={resumed}", "sft.max_steps=6", "ckpt.resume=latest", check=True)
    assert _metrics(resumed) == _metrics(straight)
    a, b = (load_file(str(d / "model" / "model.safetensors")) for d in (straight, resumed))
    assert all((a[k] == b[k]).all() for k in a)
