"""The GPU benchmarks' own code, run on the CPU: a script that only ever runs on a lent GPU would otherwise break
unseen (``trainer_mfu.py --smoke`` once did, refused by a config check it never met on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_mfu_smoke_runs_every_configuration(tmp_path):
    out = tmp_path / "mfu.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trainer_mfu.py"), "--smoke", "--row-lens", "256",
         "--attn", "varlen", "--rows", "2", "--mb-rows", "1", "2", "--steps", "1", "--warmup", "1",
         "--profile", str(tmp_path / "prof"), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r.get("error") for r in results] == [None, None], proc.stdout
    assert [r["rows_per_micro_batch"] for r in results] == [1, 2]
    assert all(r["tokens_per_s"] > 0 and r["profile_phases_s"]["step_wall"] > 0 for r in results)
    assert len(list((tmp_path / "prof").glob("*_ops.txt"))) == 2


def test_attention_kernels_runs_and_reports_missing_packages(tmp_path):
    out = tmp_path / "attn.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention_kernels.py"), "--device", "cpu", "--tokens", "300",
         "--repeats", "1", "--kernels", "torch_varlen", "no_such_kernel", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["torch_varlen"]["forward_backward_s"] > 0 and rows["torch_varlen"]["max_abs_diff_out"] == 0.0
    assert "unknown kernel" in rows["no_such_kernel"]["error"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (GPU environments)")
def test_logprobs_transport_replays_vllms_cpu_side(tmp_path):
    out = tmp_path / "lt.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "logprobs_transport.py"), "--requests", "8", "--steps", "5",
         "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]  # it also checks deferred == per-step logprobs
    assert {r["mode"] for r in json.loads(out.read_text())["rows"]} == {"plain", "per_step", "deferred"}
