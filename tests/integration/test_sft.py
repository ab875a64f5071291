"""SFT warmup: resuming from a checkpoint continues exactly where a straight run would be."""

import pytest
from safetensors.numpy import load_file

from helpers.launch import asyncrl
from helpers.metrics import learning_metrics

pytestmark = pytest.mark.slow


def _metrics(run):
    return learning_metrics(run / "metrics" / "sft.jsonl")


def test_sft_resume_matches_straight_run_and_skips_a_damaged_checkpoint(setup, tmp_path):
    base = [*setup["common"], f"model.name={setup['base_model']}", "ckpt.interval=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    asyncrl("sft", *base, f"sft.run_dir={straight}", "sft.max_steps=6", check=True)
    asyncrl("sft", *base, f"sft.run_dir={resumed}", "sft.max_steps=4", check=True)  # checkpoints 2 and 4
    bad = asyncrl("sft", *base, f"sft.run_dir={resumed}", "sft.max_steps=6", "ckpt.resume=5")
    assert bad.returncode == 2 and "ckpt.resume=5 is not a complete checkpoint" in bad.stderr
    part = resumed / "checkpoints" / "step_4" / "trainer"
    largest = max(
        (f for f in part.rglob("*") if f.is_file() and f.name != "STABLE"), key=lambda f: f.stat().st_size
    )
    with largest.open("r+b") as f:  # a crash or a full disk left it short, marker present
        f.truncate(f.seek(0, 2) // 2)
    out = asyncrl(
        "sft", *base, f"sft.run_dir={resumed}", "sft.max_steps=6", "ckpt.resume=latest", check=True
    )
    assert "skipping checkpoint step 4" in out.stderr
    assert _metrics(resumed) == _metrics(straight)
    a, b = (load_file(str(d / "model" / "model.safetensors")) for d in (straight, resumed))
    assert all((a[k] == b[k]).all() for k in a)
    # ckpt.keep_last=2
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step_4", "step_6"]
